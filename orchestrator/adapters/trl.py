"""TRL's ``GRPOTrainer`` fed by Claw: :class:`ClawRollouts` is its ``rollout_func`` (the
documented custom-rollout hook of TRL 1.16: called with the prompts of a generation batch
and the trainer, it returns ``prompt_ids``, ``completion_ids``, ``logprobs`` and extra
fields that TRL hands its reward functions) and :func:`claw_reward` its reward function.

TRL does not generate: the rollouts are whatever agents recorded through ``claw gateway``,
served as group batches (``sampler: {kind: group, once: true}``, ``tokens`` collation).
TRL normalises rewards into advantages over blocks of ``num_generations`` rows itself, so
each group's sequences are one block and each block's reward is the trajectory's return
Claw computed (``claw_reward``: the reward the agents posted). TRL 1.16 keeps a rollout's
``logprobs`` as ``sampling_per_token_logps``; without vLLM it reads them only in its
off-policy sequence mask (``off_policy_mask_threshold``), and takes the clipped ratio
against log-probs it recomputes (or, on-policy, the current ones) — docs/llm.md, "TRL".

No import of TRL here: the trainer arrives as an argument."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orchestrator.adapters.llm_trainers import trl_rollout
from orchestrator.sampling.batch import Batch

__all__ = ["ClawRollouts", "align", "claw_reward"]

Dispatch = Callable[[list[Any], Any], None]
"""``dispatch(prompts, trainer)``: start rollouts of these prompts (one group each)."""


def claw_reward(completions: list[Any], claw_reward: list[float], **kwargs: Any) -> list[float]:
    """TRL reward function: the rewards Claw served with the rollouts (the agents' own,
    posted to the gateway), one per completion."""
    return [float(r) for r in claw_reward]


def align(served: Sequence[Sequence[int]], wanted: Sequence[Sequence[int]]) -> list[int] | None:
    """For each wanted prompt (token ids), a served group with that prompt, each group used
    once; None when some wanted prompt has none (rollouts started by someone else)."""
    free: dict[tuple[int, ...], list[int]] = {}
    for g, ids in enumerate(served):
        free.setdefault(tuple(ids), []).append(g)
    order = []
    for ids in wanted:
        left = free.get(tuple(ids))
        if not left:
            return None
        order.append(left.pop(0))
    return order


class ClawRollouts:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` that returns one Claw group batch per
    call (``recipe``'s ``batch_size`` groups of ``group_size`` = ``num_generations``).

    With ``dispatch``, each call first hands it the generation batch's prompts (one per
    ``num_generations`` block), so TRL's dataset decides what is rolled out; the served
    groups are then put in TRL's order when their prompt ids match TRL's prompts
    (``prompt_ids(prompt, trainer)``; default: the trainer's tokenizer, no special tokens),
    else left in Claw's order (counted in ``unaligned``). Without it, TRL's prompts only
    set the batch size: agents elsewhere decide what is rolled out. ``on_wait()`` runs
    every ``poll`` seconds while no batch is ready (raise there to stop); after
    ``timeout`` seconds the pop's ``TimeoutError`` propagates. ``batches`` keeps the last
    ``keep`` batches served (for checks)."""

    def __init__(
        self,
        client: Any,
        recipe: str,
        *,
        dispatch: Dispatch | None = None,
        prompt_ids: Callable[[Any, Any], list[int]] | None = None,
        timeout: float = 300.0,
        poll: float = 5.0,
        on_wait: Callable[[], None] | None = None,
        keep: int = 0,
    ) -> None:
        self.client, self.recipe = client, recipe
        self.dispatch, self.prompt_ids = dispatch, prompt_ids or _tokenize
        self.timeout, self.poll, self.on_wait = timeout, poll, on_wait
        self.keep, self.batches, self.unaligned = keep, [], 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        g = int(trainer.num_generations)
        if not prompts or len(prompts) % g:
            raise ValueError(f"{len(prompts)} prompts are not blocks of num_generations={g}")
        wanted = prompts[::g]
        if self.dispatch is not None:
            self.dispatch(wanted, trainer)
        batch = self._pop(trainer.state.global_step)
        out = trl_rollout(batch, g)
        groups = len(out["prompt_ids"]) // g
        if groups != len(wanted):
            raise ValueError(
                f"the recipe served {groups} groups, TRL asked for {len(wanted)}: set its "
                "batch_size to generation_batch_size / num_generations"
            )
        if self.dispatch is not None:
            order = self._order(out, wanted, g, trainer)
            if order is None:
                self.unaligned += 1
            else:
                rows = (np.asarray(order)[:, None] * g + np.arange(g)).ravel()
                out = {k: [v[i] for i in rows] for k, v in out.items()}
        if self.keep:
            self.batches = [*self.batches, batch][-self.keep :]
        return out

    def _order(self, out: dict[str, list[Any]], wanted: list[Any], g: int, trainer: Any) -> Any:
        try:
            ids = [self.prompt_ids(p, trainer) for p in wanted]
        except (TypeError, ValueError):  # e.g. chat prompts without a prompt_ids function
            return None
        return align(out["prompt_ids"][::g], ids)

    def _pop(self, step: int) -> Batch:
        """The next batch, recorded in the lineage log as trained by update ``step``."""
        deadline = time.monotonic() + self.timeout
        while True:
            wait = max(0.0, min(self.poll, deadline - time.monotonic()))
            try:
                return self.client.pop(self.recipe, timeout=wait, policy_version=step)
            except TimeoutError:
                if self.on_wait is not None:
                    self.on_wait()
                if time.monotonic() >= deadline:
                    raise


def _tokenize(prompt: Any, trainer: Any) -> list[int]:
    if not isinstance(prompt, str):
        raise TypeError("not a text prompt")
    return list(trainer.processing_class(prompt, add_special_tokens=False)["input_ids"])

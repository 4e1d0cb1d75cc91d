"""TRL's GRPOTrainer trains a tiny GPT-2 on rollouts recorded by ``claw gateway``.

The model is a 2-layer GPT-2 with random weights (transformers, built from a config) over a
14-token character tokenizer built here (``tokenizers``): nothing is downloaded. The task
is verifiable: for ``a+b=`` (a, b in 0..4) the completion (up to 2 tokens) must start with
the digit of the sum. A small OpenAI-compatible server of this script's own generates with
the very model TRL trains (``/v1/completions``, returning token ids and log-probs the way
vLLM does, and the trainer's step in an ``X-Claw-Policy-Version`` header); this script
starts ``claw gateway`` in front of it (a subprocess). TRL's ``GRPOTrainer`` gets
``rollout_func=ClawRollouts(...)`` (``orchestrator.adapters.trl``): for each generation
batch it hands TRL's prompts to agent threads, which roll out through the gateway with the
real ``openai`` client (one call per sample, ``base_url=<gateway>/t/<trajectory>/g/<group>/v1``)
and post each reward to the gateway; then it pops the Claw group batch (``sampler: {kind:
group, once: true}``, ``tokens`` collation) and returns its token ids, log-probs and
rewards to TRL, which computes the group advantages and takes the step. Needs the workers
and the trl extra (``pip install -e '.[trl]'``):

    claw up                                   # in another terminal
    python examples/trl_grpo.py --updates 200
"""

from __future__ import annotations

import os

# Nothing from the Hugging Face hub: no downloads, no telemetry (TRL's trainers send it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

import argparse
import json
import tempfile
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from datasets import Dataset
from gateway_agents import CompletionServer, Gateway, rollout
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    PrinterCallback,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer

from orchestrator import BatchClient
from orchestrator.adapters.llm_trainers import trl_rollout
from orchestrator.adapters.trl import ClawRollouts, claw_reward

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renames
PROMPTS = [f"{a}+{b}=" for a in range(5) for b in range(5)]


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ``0123456789+=``, and ``<pad>`` (0), ``<eos>`` (1)."""
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def model(vocab: int, seed: int) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with random weights and no dropout (the server's log-probs are then
    the trainer's, whatever mode the module is in)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=8,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


def verify(prompt: str, completion: str) -> float:
    """1 when the completion starts with the digit of the sum."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    return float(completion[:1] == str(a + b))


def success_rate(policy: GPT2LMHeadModel, tok: PreTrainedTokenizerFast) -> float:
    """The exact expected success of the sampling policy over every prompt: the probability
    of the sum's digit as the first token."""
    ids = torch.tensor([tok(p)["input_ids"] for p in PROMPTS])
    right = torch.tensor([tok(str(int(p[0]) + int(p[2])))["input_ids"][0] for p in PROMPTS])
    with torch.no_grad():
        p = torch.softmax(policy(ids).logits[:, -1].float(), -1)
    return float(p[torch.arange(len(PROMPTS)), right].mean())


# ---- the inference server ----------------------------------------------------------------
class Server(CompletionServer):
    """An OpenAI-compatible ``/v1/completions`` endpoint for the policy being trained: the
    reply carries vLLM's ``prompt_token_ids`` and ``token_ids`` per choice and
    ``logprobs.token_logprobs`` (tokens spelled ``token_id:<n>`` when asked), and the
    policy version (the trainer's step) in the ``X-Claw-Policy-Version`` header. Every
    generation is kept in ``log`` (the truth the checks compare with)."""

    def __init__(self, policy: GPT2LMHeadModel, tok: PreTrainedTokenizerFast, seed: int):
        self.policy, self.tok, self.version = policy, tok, 0
        self.lock, self.log = threading.Lock(), []
        self.rng = torch.Generator().manual_seed(seed)
        super().__init__()

    def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        prompt = body["prompt"]
        ids = (
            self.tok(prompt, add_special_tokens=False)["input_ids"]
            if isinstance(prompt, str)
            else [int(t) for t in prompt]
        )
        eos = self.tok.eos_token_id
        out: list[int] = []
        lps: list[float] = []
        with self.lock, torch.no_grad():
            for _ in range(int(body.get("max_tokens") or 2)):
                logits = self.policy(torch.tensor([ids + out])).logits[0, -1]
                logp = torch.log_softmax(logits.float(), -1)
                t = int(torch.multinomial(logp.exp(), 1, generator=self.rng))
                out.append(t)
                lps.append(float(logp[t]))
                if t == eos:
                    break
            version = self.version
            self.log.append(
                {"prompt_ids": ids, "response_ids": out, "logprobs": lps, "version": version}
            )
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choice = {
            "index": 0,
            "text": self.tok.decode(out, skip_special_tokens=True),
            "token_ids": out,
            "prompt_token_ids": ids,
            "logprobs": {
                "tokens": [f"token_id:{t}" if as_ids else self.tok.decode([t]) for t in out],
                "token_logprobs": lps,
                "top_logprobs": [{} for _ in out],
                "text_offset": [],
            },
            "finish_reason": "stop" if out[-1] == eos else "length",
        }
        reply = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "tiny-gpt2"),
            "choices": [choice],
        }
        return reply, version


# ---- agents --------------------------------------------------------------------------------
class Agents:
    """Agent threads. ``dispatch`` (ClawRollouts calls it with each generation batch's
    prompts) starts ``group_size`` trajectories of each prompt, one group per prompt; each
    is one call through the gateway with the OpenAI client, then its reward posted to the
    gateway (which ends the trajectory). ``check`` raises an agent's failure."""

    def __init__(self, gw: Gateway, server: Server, group_size: int, threads: int) -> None:
        self.gw, self.server, self.group_size = gw, server, group_size
        limits = httpx.Limits(max_connections=threads, max_keepalive_connections=threads)
        self.http = httpx.Client(timeout=120, limits=limits)
        self.pool = ThreadPoolExecutor(threads)
        self.errors: list[BaseException] = []

    def dispatch(self, prompts: list[str], trainer: Any) -> None:
        self.server.version = trainer.state.global_step  # the weights that will answer
        for prompt in prompts:
            group = uuid.uuid4().hex
            for j in range(self.group_size):
                f = self.pool.submit(self.rollout, f"{group}-{j}", group, prompt)
                f.add_done_callback(self._done)

    def rollout(self, traj: str, group: str, prompt: str) -> None:
        rollout(
            self.http,
            self.gw,
            traj,
            group,
            prompt,
            model="tiny-gpt2",
            max_tokens=2,
            reward=lambda text: verify(prompt, text),
        )

    def _done(self, f: Future) -> None:
        if not f.cancelled() and f.exception() is not None:
            self.errors.append(f.exception())

    def check(self) -> None:
        if self.errors:
            raise RuntimeError(f"an agent failed: {self.errors[0]!r}") from self.errors[0]

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
        self.http.close()


# ---- the trainer ---------------------------------------------------------------------------
def recipe(groups: int, group_size: int) -> dict[str, Any]:
    """Whole groups of ended trajectories, each served once (on-policy)."""
    return {
        "name": "trl-grpo",
        "batch_size": groups,
        "fields": ["prompt_ids", "response_ids", "response_logprobs"],
        "sources": [
            {
                "name": "rollouts",
                "sampler": {
                    "kind": "group",
                    "group_by": "prompt_uid",
                    "group_size": group_size,
                    "once": True,
                    "passes": 1,
                },
            }
        ],
        "tokens": {"mode": "transition", "pad_token_id": 0},
        "prefetch": {"depth": 2},
    }


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that keeps what each loss computation was given (``--record``): the
    rows' prompt ids, completion ids, sampling log-probs, loss mask and advantage."""

    consumed: list[dict[str, Any]]

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kw: Any) -> Any:
        pm, cm = inputs["prompt_mask"].bool(), inputs["completion_mask"].bool()
        loss = cm & inputs.get("tool_mask", cm).bool()
        for i in range(len(pm)):
            self.consumed.append(
                {
                    "step": self.state.global_step,
                    "prompt_ids": inputs["prompt_ids"][i][pm[i]].tolist(),
                    "completion_ids": inputs["completion_ids"][i][cm[i]].tolist(),
                    "logprobs": inputs["sampling_per_token_logps"][i][cm[i]].tolist(),
                    "loss_mask": loss[i][cm[i]].int().tolist(),
                    "advantage": float(inputs["advantages"][i]),
                }
            )
        return super().compute_loss(model, inputs, *args, **kw)


class Progress(TrainerCallback):
    """One line per update: TRL's mean reward of the batch and the exact success rate."""

    def __init__(self, policy: GPT2LMHeadModel, tok: PreTrainedTokenizerFast) -> None:
        self.policy, self.tok, self.rate = policy, tok, success_rate(policy, tok)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "reward" in logs:
            self.rate = success_rate(self.policy, self.tok)
            print(
                f"update {state.global_step}: reward {logs['reward']:.3f}, "
                f"loss {logs.get('loss', float('nan')):+.3f}, success {self.rate:.1%}",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="trl-grpo")
    p.add_argument("--updates", type=int, default=200)
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) per batch")
    p.add_argument("--group-size", type=int, default=8, help="TRL's num_generations")
    p.add_argument("--agents", type=int, default=16, help="agent threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--iterations", type=int, default=1, help="TRL's num_iterations")
    p.add_argument("--record", type=Path, help="write what was served and consumed (JSON)")
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = tokenizer()
    policy = model(len(tok), args.seed)
    n_params = sum(x.numel() for x in policy.parameters())
    server = Server(policy, tok, args.seed)
    gw = Gateway(server.url, args.namespace)
    agents = Agents(gw, server, args.group_size, args.agents)
    progress = Progress(policy, tok)
    start = progress.rate
    print(
        f"GPT-2 of {n_params} parameters at {server.url}, agents call it through claw "
        f"gateway at {gw.url}; success {start:.1%}",
        flush=True,
    )
    t0 = time.monotonic()
    try:
        with BatchClient(args.namespace) as client, tempfile.TemporaryDirectory() as out:
            client.register(recipe(args.groups, args.group_size))
            rollouts = ClawRollouts(
                client,
                "trl-grpo",
                dispatch=agents.dispatch,
                on_wait=agents.check,
                keep=args.updates if args.record else 0,
            )
            config = GRPOConfig(
                output_dir=out,
                per_device_train_batch_size=args.groups * args.group_size,
                num_generations=args.group_size,
                max_completion_length=2,
                num_iterations=args.iterations,
                max_steps=args.updates,
                learning_rate=args.lr,
                lr_scheduler_type="constant",
                off_policy_mask_threshold=0.5,  # TRL's use of the served log-probs
                logging_steps=1,
                report_to="none",
                save_strategy="no",
                use_cpu=True,
                disable_tqdm=True,
                seed=args.seed,
            )
            trainer = RecordingGRPOTrainer(
                model=policy,
                reward_funcs=claw_reward,
                args=config,
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                processing_class=tok,
                rollout_func=rollouts,
                callbacks=[progress],
            )
            trainer.remove_callback(PrinterCallback)
            trainer.consumed = []
            trainer.train()
    finally:
        agents.close()
        gw.stop()
        server.http.shutdown()
    took = time.monotonic() - t0
    print(f"served {len(server.log)} completions; {rollouts.unaligned} batches out of TRL's order")
    if args.record:
        served = [
            {"batch": k, **row}
            for k, b in enumerate(rollouts.batches)
            for row in _rows(b, args.group_size)
        ]
        record = {"generated": server.log, "served": served, "consumed": trainer.consumed}
        args.record.write_text(json.dumps(record))
    print(
        f"done: {trainer.state.global_step} updates in {took:.0f} s; success {start:.1%} -> "
        f"{progress.rate:.1%} ({(progress.rate - start) * 100:+.1f} points)"
    )


def _rows(batch: Any, group_size: int) -> list[dict[str, Any]]:
    """A served batch as the adapter handed it to TRL, one dict per row."""
    out = trl_rollout(batch, group_size)
    return [dict(zip(out, values, strict=True)) for values in zip(*out.values(), strict=True)]


if __name__ == "__main__":
    main()

"""GRPO end to end on a toy task: a tiny torch policy learns to add two digits.

The policy (about 3,200 parameters, its own 15-token vocabulary, nothing downloaded) is
served by a small OpenAI-compatible server of this script's own (``/v1/completions``,
returning token ids and log-probs the way vLLM does, and the policy version that sampled
each reply in an ``X-Claw-Policy-Version`` header). This script starts ``claw gateway``
in front of it (a subprocess), and agent threads roll out through the gateway with the
real ``openai`` client: for each prompt ``a+b=`` (a, b in 0..4) a group of
``--group-size`` trajectories, each one call to ``base_url=<gateway>/t/<trajectory>/g/<group>/v1``
(the gateway records it as one LLM turn: token ids, log-probs, policy version), then its
reward (1 when the digit is the sum) posted to the gateway's ``/t/<trajectory>/reward``,
which ends the trajectory. The trainer pops group batches from Claw
(``sampler: {kind: group, once: true}``, ``tokens`` collation, GRPO advantages computed
by the prefetch workers), takes a clipped policy-gradient step, publishes the new policy
version, and bounds staleness with the live param ``min_version``. Needs torch, the
agents' clients and the workers:

    pip install -e '.[torch,agents]'
    claw up                                   # in another terminal
    python examples/grpo_toy.py --updates 150
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import torch
from gateway_agents import CompletionServer, Gateway, rollout
from torch import nn

from orchestrator import BatchClient
from orchestrator.adapters.llm_trainers import token_tensors

PAD, BOS, EOS, PLUS, EQ = 0, 1, 2, 3, 4
DIGIT = 5  # tokens 5..14 are the digits 0..9
VOCAB, WINDOW = 15, 4


class Policy(nn.Module):
    """Next-token logits from the last ``WINDOW`` tokens (embedded, concatenated, an MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mlp = nn.Sequential(nn.Linear(8 * WINDOW, 64), nn.Tanh(), nn.Linear(64, VOCAB))

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(windows).flatten(-2))

    def token_logprobs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, T) log-prob of each token given the tokens before it (position 0: 0), and
        (S, T) the entropy of the distribution it was drawn from."""
        padded = torch.nn.functional.pad(ids, (WINDOW, 0), value=PAD)
        win = padded.unfold(1, WINDOW, 1)[:, :-1]  # (S, T, WINDOW): the context of token t
        dist = torch.log_softmax(self(win), -1)
        logp = dist.gather(-1, ids[..., None])[..., 0]
        logp = torch.cat([torch.zeros_like(logp[:, :1]), logp[:, 1:]], 1)
        return logp, -(dist.exp() * dist).sum(-1)


def prompt_of(a: int, b: int) -> list[int]:
    return [BOS, DIGIT + a, PLUS, DIGIT + b, EQ]


PROMPTS = [(a, b) for a in range(5) for b in range(5)]


def success_rate(policy: Policy) -> float:
    """The exact expected success of the sampling policy over every prompt."""
    with torch.no_grad():
        ctx = torch.tensor([prompt_of(a, b)[-WINDOW:] for a, b in PROMPTS])
        p = torch.softmax(policy(ctx), -1)
        right = torch.tensor([DIGIT + a + b for a, b in PROMPTS])
        return float(p[torch.arange(len(PROMPTS)), right].mean())


# ---- the inference server ----------------------------------------------------------------
class Server(CompletionServer):
    """An OpenAI-compatible ``/v1/completions`` endpoint for the policy: ``prompt`` is a list
    of token ids; the reply carries ``prompt_token_ids``, ``token_ids`` and
    ``logprobs.token_logprobs`` per choice (vLLM's fields), and the policy version in the
    ``X-Claw-Policy-Version`` header (which the gateway records)."""

    def __init__(self, policy: Policy, lock: threading.Lock, seed: int) -> None:
        self.policy, self.lock, self.version = policy, lock, 0
        self.rng = torch.Generator().manual_seed(seed)
        super().__init__()

    def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        ids = [int(t) for t in body["prompt"]]
        choices = []
        with self.lock, torch.no_grad():
            for i in range(int(body.get("n", 1))):
                ctx = torch.tensor([ids[-WINDOW:]])
                logp = torch.log_softmax(self.policy(ctx)[0], -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=self.rng))
                choices.append(
                    {
                        "index": i,
                        "text": str(tok - DIGIT),
                        "token_ids": [tok],
                        "logprobs": {"token_logprobs": [float(logp[tok])]},
                        "finish_reason": "length",
                    }
                )
            version = self.version
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "model": "toy",
            "prompt_token_ids": ids,
            "choices": choices,
        }, version


# ---- agents ------------------------------------------------------------------------------
class Pace:
    """Keeps the agents at most ``ahead`` groups ahead of the trainer (fresh rollouts)."""

    def __init__(self, ahead: int) -> None:
        self.ahead, self.made, self.trained = ahead, 0, 0
        self.cond = threading.Condition()

    def wait_turn(self, stop: threading.Event) -> bool:
        with self.cond:
            while self.made >= self.trained + self.ahead and not stop.is_set():
                self.cond.wait(0.1)
            self.made += 1
            return not stop.is_set()

    def consumed(self, groups: int) -> None:
        with self.cond:
            self.trained += groups
            self.cond.notify_all()


def reward_of(a: int, b: int) -> Callable[[str], float]:
    """1 when the completion is the digit of the sum."""
    return lambda text: float(text == str(a + b))


def agents(
    gw: Gateway,
    group_size: int,
    seed: int,
    stop: threading.Event,
    pace: Pace,
    errors: list[BaseException],
    threads: int,
) -> None:
    """Rollout groups until ``stop``: each is ``group_size`` trajectories of one prompt,
    run by a pool of agent threads (a reward post waits for the turn's commit)."""
    rng = np.random.default_rng(seed)

    def check(f: Future) -> None:
        if not f.cancelled() and f.exception() is not None and not stop.is_set():
            errors.append(f.exception())
            stop.set()

    limits = httpx.Limits(max_connections=threads, max_keepalive_connections=threads)
    with httpx.Client(timeout=120, limits=limits) as http, ThreadPoolExecutor(threads) as pool:
        while pace.wait_turn(stop):
            a, b = PROMPTS[rng.integers(len(PROMPTS))]
            group = uuid.uuid4().hex
            for j in range(group_size):
                pool.submit(
                    rollout,
                    http,
                    gw,
                    f"{group}-{j}",
                    group,
                    prompt_of(a, b),
                    model="toy",
                    max_tokens=1,
                    reward=reward_of(a, b),
                ).add_done_callback(check)
        pool.shutdown(cancel_futures=True)


# ---- the trainer -------------------------------------------------------------------------
def recipe(groups: int, group_size: int) -> dict[str, Any]:
    return {
        "name": "grpo-toy",
        "batch_size": groups,
        "fields": ["prompt_ids", "response_ids", "response_logprobs"],
        "params": {"min_version": 0},
        "sources": [
            {
                "name": "rollouts",
                "where": "policy_version >= $min_version",
                "sampler": {
                    "kind": "group",
                    "group_by": "prompt_uid",
                    "group_size": group_size,
                    "once": True,
                    "passes": 1,
                },
            }
        ],
        "tokens": {"mode": "transition", "advantage": "grpo"},
        "prefetch": {"depth": 4},
    }


def grpo_step(
    policy: Policy,
    opt: torch.optim.Optimizer,
    batch: Any,
    epochs: int,
    entropy_coef: float,
    clip: float = 0.2,
) -> float:
    """``epochs`` clipped policy-gradient steps on one batch (GRPO's inner iterations: the
    ratio to the behaviour policy's log-probs, recorded by the gateway, keeps them close),
    with an entropy bonus (a prompt whose answers all agree gives no signal again)."""
    t = token_tensors(batch)
    mask, adv = t["loss_mask"], t["advantages"]
    for _ in range(epochs):
        new, entropy = policy.token_logprobs(t["input_ids"])
        ratio = torch.exp(new - t["old_logprobs"])
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        surrogate = surrogate + entropy_coef * entropy
        loss = -(surrogate * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="grpo-toy")
    p.add_argument("--updates", type=int, default=150)
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) per batch")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--agents", type=int, default=32, help="agent threads")
    p.add_argument("--lag", type=int, default=8, help="policy versions a rollout may lag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=4, help="gradient steps per batch")
    p.add_argument("--entropy", type=float, default=0.02, help="entropy bonus coefficient")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop after this long")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    policy, lock = Policy(), threading.Lock()
    n_params = sum(x.numel() for x in policy.parameters())
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    server = Server(policy, lock, args.seed)
    gw = Gateway(server.url, args.namespace)
    start = success_rate(policy)
    print(
        f"policy of {n_params} parameters at {server.url}, agents call it through "
        f"claw gateway at {gw.url}; success {start:.1%}",
        flush=True,
    )
    stop, errors = threading.Event(), []
    pace = Pace(2 * args.groups)
    agent = threading.Thread(
        target=agents,
        args=(gw, args.group_size, args.seed, stop, pace, errors, args.agents),
        daemon=True,
    )
    agent.start()
    t0 = time.monotonic()
    rate, update = start, 0
    try:
        with BatchClient(args.namespace) as client:
            client.register(recipe(args.groups, args.group_size))
            for update in range(1, args.updates + 1):
                while True:
                    try:
                        batch = client.pop("grpo-toy", timeout=5)
                        break
                    except TimeoutError:
                        if errors:
                            raise RuntimeError(f"an agent failed: {errors[0]!r}") from errors[0]
                        if time.monotonic() - t0 > args.budget_s + 120:
                            raise
                sizes = np.bincount(batch["group_index"])
                with lock:
                    loss = grpo_step(policy, opt, batch, args.epochs, args.entropy)
                    server.version = update
                pace.consumed(len(sizes))
                rate = success_rate(policy)
                print(
                    f"update {update}: {len(sizes)} groups of {sorted(set(sizes.tolist()))} "
                    f"trajectories, loss {loss:+.3f}, success {rate:.1%}",
                    flush=True,
                )
                if update % args.lag == 0:
                    client.set_params("grpo-toy", min_version=update - args.lag)
                if time.monotonic() - t0 > args.budget_s:
                    break
    finally:
        stop.set()
        agent.join(timeout=60)
        counts = gw.counts()
        gw.stop()
        server.http.shutdown()
    took = time.monotonic() - t0
    print(
        f"gateway: {counts['claw_gateway_recorded_turns_total']:.0f} turns recorded, "
        f"{counts['claw_gateway_rewarded_trajectories_total']:.0f} trajectories rewarded"
    )
    print(
        f"done: {update} updates in {took:.0f} s; success {start:.1%} -> {rate:.1%} "
        f"({(rate - start) * 100:+.1f} points)"
    )


if __name__ == "__main__":
    main()

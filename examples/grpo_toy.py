"""GRPO end to end on a toy task: a tiny torch policy learns to add two digits.

The policy (about 3,500 parameters, its own 15-token vocabulary, nothing downloaded) is
served by a small OpenAI-compatible server of this script's own (``/v1/completions``,
returning token ids and log-probs the way vLLM does). Agent threads ask it for rollouts:
for each prompt ``a+b=`` (a, b in 0..4) a group of ``--group-size`` completions, each
rewarded 1 when its digit is the sum. Each rollout is recorded as one LLM turn with
``Ingestor.llm_turn`` (trajectory = rollout, ``prompt_uid`` = the group, ``is_last``, the
policy version). The trainer pops group batches (``sampler: {kind: group, once: true}``,
``tokens`` collation, GRPO advantages computed by the prefetch workers), takes a clipped
policy-gradient step, publishes the new policy version, and bounds staleness with the live
param ``min_version``. Needs a running stack:

    claw up                                   # in another terminal
    python examples/grpo_toy.py --updates 150
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from torch import nn

from claw_tasks.client import Ingestor
from claw_tasks.schema import Schema
from orchestrator import BatchClient
from orchestrator.adapters.llm import token_tensors

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

    def token_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """(S, T) log-prob of each token given the tokens before it (position 0: 0)."""
        padded = torch.nn.functional.pad(ids, (WINDOW, 0), value=PAD)
        win = padded.unfold(1, WINDOW, 1)[:, :-1]  # (S, T, WINDOW): the context of token t
        logp = torch.log_softmax(self(win), -1).gather(-1, ids[..., None])[..., 0]
        return torch.cat([torch.zeros_like(logp[:, :1]), logp[:, 1:]], 1)


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
class Server:
    """An OpenAI-compatible ``/v1/completions`` endpoint for the policy: ``prompt`` is a list
    of token ids; the reply carries ``prompt_token_ids``, ``token_ids`` and
    ``logprobs.token_logprobs`` per choice (vLLM's fields)."""

    def __init__(self, policy: Policy, lock: threading.Lock, seed: int) -> None:
        self.policy, self.lock, self.version = policy, lock, 0
        self.rng = torch.Generator().manual_seed(seed)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = json.dumps(server.complete(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [int(t) for t in body["prompt"]]
        choices = []
        with self.lock, torch.no_grad():
            for i in range(int(body.get("n", 1))):
                ctx = torch.tensor([ids[-WINDOW:]])
                logp = torch.log_softmax(self.policy(ctx)[0], -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=self.rng))
                choices.append({
                    "index": i, "text": str(tok - DIGIT), "token_ids": [tok],
                    "logprobs": {"token_logprobs": [float(logp[tok])]},
                    "finish_reason": "length",
                })  # fmt: skip
            version = self.version
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": "toy",
            "prompt_token_ids": ids, "choices": choices, "policy_version": version,
        }  # fmt: skip


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


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


def agents(url: str, ingestor: Ingestor, group_size: int, seed: int, stop: threading.Event,
           pace: Pace) -> None:  # fmt: skip
    """Rollout groups until ``stop``: each is ``group_size`` trajectories of one prompt."""
    rng = np.random.default_rng(seed)
    while pace.wait_turn(stop):
        a, b = PROMPTS[rng.integers(len(PROMPTS))]
        group = uuid.uuid4().hex
        prompt = prompt_of(a, b)
        for j in range(group_size):
            out = post(f"{url}/completions", {"model": "toy", "prompt": prompt, "max_tokens": 1,
                                              "logprobs": 1})  # fmt: skip
            choice = out["choices"][0]
            reward = float(choice["token_ids"][0] == DIGIT + a + b)
            ingestor.llm_turn(
                f"{group}-{j}", 0, out["prompt_token_ids"], choice["token_ids"],
                choice["logprobs"]["token_logprobs"], prompt_uid=group, reward=reward,
                is_last=True, policy_version=out["policy_version"], reward_source="exact",
            )  # fmt: skip


# ---- the trainer -------------------------------------------------------------------------
def recipe(groups: int, group_size: int) -> dict[str, Any]:
    return {
        "name": "grpo-toy",
        "batch_size": groups,
        "fields": ["prompt_ids", "response_ids", "response_logprobs"],
        "params": {"min_version": 0},
        "sources": [{
            "name": "rollouts",
            "where": "policy_version >= $min_version",
            "sampler": {"kind": "group", "group_by": "prompt_uid", "group_size": group_size,
                        "once": True},
        }],
        "tokens": {"mode": "transition", "advantage": "grpo"},
        "prefetch": {"depth": 4},
    }  # fmt: skip


def grpo_step(policy: Policy, opt: torch.optim.Optimizer, batch: Any, clip: float = 0.2) -> float:
    t = token_tensors(batch)
    new = policy.token_logprobs(t["input_ids"])
    mask = t["loss_mask"]
    ratio = torch.exp(new - t["old_logprobs"])
    adv = t["advantages"]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
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
    p.add_argument("--lag", type=int, default=8, help="policy versions a rollout may lag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop after this long")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    policy, lock = Policy(), threading.Lock()
    n_params = sum(x.numel() for x in policy.parameters())
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    server = Server(policy, lock, args.seed)
    start = success_rate(policy)
    print(f"policy of {n_params} parameters at {server.url}; success {start:.1%}", flush=True)
    stop = threading.Event()
    ingestor = Ingestor(args.namespace, schema=Schema.llm(), flush_interval=0.2)
    pace = Pace(2 * args.groups)
    agent = threading.Thread(
        target=agents, args=(server.url, ingestor, args.group_size, args.seed, stop, pace),
        daemon=True,
    )  # fmt: skip
    agent.start()
    t0 = time.monotonic()
    rate = start
    try:
        with BatchClient(args.namespace) as client:
            client.register(recipe(args.groups, args.group_size))
            for update in range(1, args.updates + 1):
                batch = client.pop("grpo-toy", timeout=120)
                sizes = np.bincount(batch["group_index"])
                with lock:
                    loss = grpo_step(policy, opt, batch)
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
        agent.join(timeout=30)
        ingestor.close()
        server.http.shutdown()
    took = time.monotonic() - t0
    print(f"done: {update} updates in {took:.0f} s; success {start:.1%} -> {rate:.1%} "
          f"({(rate - start) * 100:+.1f} points)")  # fmt: skip


if __name__ == "__main__":
    main()

"""Actors and checks the rollout tests share: actors recording segments of long episodes
with known numbers, the recipe, and what a popped rollout must hold."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np

from claw_tasks.client import Ingestor
from orchestrator import BatchClient

GAMMA, LAM = 0.97, 0.9
STRAGGLER = 9  # the obs[0] of steps recorded by a slow actor at an old version


def recipe(max_lag: int = 0, **rollout: Any) -> dict[str, Any]:
    return {
        "name": "ppo",
        "batch_size": 16,
        "fields": ["obs", "action"],
        "sources": [{"name": "actors"}],
        "params": {"policy_version": 0},
        "gamma": GAMMA,
        "prefetch": {"depth": 12},
        "rollout": {
            "steps": 64,
            "epochs": 3,
            "max_lag": max_lag,
            "gae_lambda": LAM,
            "normalize": False,
            **rollout,
        },
    }


class Actor:
    """Records segments of long episodes (they terminate or are truncated now and then),
    each step's obs naming it: (actor, episode, step_index)."""

    def __init__(self, ingestor: Ingestor, k: int, records: dict, seed: int) -> None:
        self.ing, self.k, self.records = ingestor, k, records
        self.rng = np.random.default_rng(seed)
        self.ep: Any = None
        self.ep_no = self.t = 0

    def segment(self, n: int, version: int, *, k: int | None = None) -> None:
        rng = self.rng
        for i in range(n):
            if self.ep is None:
                self.ep_no += 1
                self.ep, self.t = self.ing.episode(agent_id=f"a{self.k}"), 0
            key = (self.k if k is None else k, self.ep_no, self.t)
            term = bool(rng.random() < 0.06)
            trunc = not term and bool(rng.random() < 0.04)
            rec = {
                "reward": float(np.float32(rng.normal())),
                "value": float(rng.normal()),
                "log_prob": float(-rng.random()),
                "terminated": term,
                "version": version,
                "episode": (key[0], key[1]),
            }
            tags = {"log_prob": rec["log_prob"], "value": rec["value"]}
            if trunc or (i == n - 1 and not term):
                tags["bootstrap_value"] = rec["bootstrap"] = float(rng.normal())
            self.ep.add(
                np.array(key, np.float32),
                np.int64(i % 2),
                rec["reward"],
                terminated=term,
                truncated=trunc,
                policy_version=version,
                **tags,
            )
            self.records[key] = rec
            self.t += 1
            if term or trunc:
                self.ep = None


def keys_of(batch) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in row) for row in batch["obs"]]


def gae_reference(taken: set, records: dict) -> dict:
    """GAE of the rollout's steps from the recorded numbers: chains are an episode's
    consecutive steps in the rollout; a chain's end bootstraps with its own
    bootstrap_value, else the next step's recorded value."""
    adv = {}
    for key in sorted(taken, key=lambda k: (k[0], k[1], -k[2])):  # each episode backwards
        rec = records[key]
        nxt = (key[0], key[1], key[2] + 1)
        if rec["terminated"]:
            v_next, a_next = 0.0, 0.0
        elif nxt in taken:
            v_next, a_next = records[nxt]["value"], adv[nxt]
        else:
            v_next = rec.get("bootstrap", records.get(nxt, {}).get("value"))
            a_next = 0.0
        delta = rec["reward"] + GAMMA * v_next - rec["value"]
        adv[key] = delta + GAMMA * LAM * (0.0 if rec["terminated"] else 1.0) * a_next
    return adv


def wait_state(client: BatchClient, prefix: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats("ppo")["ppo"]
        if str(st["state"]).startswith(prefix) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def pop_rollout(client: BatchClient, records: dict, window: tuple[int, int]) -> set:
    """Pop one rollout's 3 epochs x 4 minibatches; check what each holds; its steps."""
    epochs: list[Counter] = [Counter() for _ in range(3)]
    nos = set()
    for k in range(12):
        b = client.pop("ppo", timeout=60)
        ro = b.meta["rollout"]
        assert (ro["epoch"], ro["minibatch"]) == divmod(k, 4)
        nos.add(ro["no"])
        keys = keys_of(b)
        assert len(keys) == 16
        versions = b["policy_version"]
        assert ((versions >= window[0]) & (versions <= window[1])).all(), versions
        assert [records[key]["version"] for key in keys] == versions.tolist()
        np.testing.assert_allclose(
            b["log_prob"], [records[key]["log_prob"] for key in keys], atol=1e-6
        )
        np.testing.assert_allclose(b["value"], [records[key]["value"] for key in keys], atol=1e-6)
        epochs[ro["epoch"]].update(keys)
    assert len(nos) == 1
    taken = set(epochs[0])
    for counts in epochs:  # every step of the rollout exactly once in each epoch
        assert set(counts) == taken and set(counts.values()) == {1}
    assert len(taken) == 64
    return taken

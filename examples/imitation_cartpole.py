"""Behaviour cloning and a DAgger loop on CartPole, from an expert and a noisy second source.

1. An expert (a linear controller that balances for 500 steps) is recorded into the
   namespace ``<ns>`` through the Ingestor (``tags.origin = expert``).
2. A second demonstrator's log lands in ``<ns>-raw`` in its own representation: ``state``
   float64 with the features reversed and in tenths, ``act`` one-hot, and a broken sensor
   (NaNs, out-of-range readings, glitches far from every other state). A cleaning spec
   maps it into ``<ns>`` and quarantines the bad steps (curated, counted by rule).
3. A vector index over ``obs`` lets anyone ask for the expert steps nearest a state.
4. Behaviour cloning: logistic regression trained on batches of every trainable step of
   ``<ns>`` (the quarantined ones are never drawn), popped from the prefetch workers and
   standardised there by the namespace's global statistics (``running_normalize`` with
   ``scope: namespace``; each batch names their version, the learner checks it).
5. DAgger: the learner plays, its states are recorded into ``<ns>-learner``; a recipe
   there attaches each row's k nearest expert steps (``nearest``, computed in the prefetch
   workers); where they agree, their action labels the learner's own state; train on the
   demonstrations and the relabelled states together (DAgger's aggregate), repeat.

It prints the mean return of 10 evaluation episodes after BC and after each DAgger round
(CartPole-v1's best is 500), then a JSON line of its bookkeeping: steps recorded and bad
by kind, the cleaning's counts by rule, batches served and how many rows of them were bad
(none may be) or normalised by other statistics (none may be). ``--short`` (CI) runs a few
episodes and updates: the bookkeeping, not the learning. Needs a running stack (``claw
up``); the maintenance steps (cleaning, index updates) run here too, so the script does
not wait for beat ticks:

    python examples/imitation_cartpole.py [--short]
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import numpy as np

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator import BatchClient
from orchestrator.delivery.augstats import namespace_stats
from orchestrator.maintenance.cleaning import clean_source, define_source, quarantined, sources
from orchestrator.maintenance.vectors import update_indexes
from orchestrator.retrieval import define_index
from orchestrator.transforms.running import RunningStats

EXPERT = np.array([0.1, 0.5, 1.0, 0.5])
CLEANING = {
    "rename": {"state": "obs", "act": "action"},
    "fields": {
        "obs": {"take": [3, 2, 1, 0], "scale": 0.1, "dtype": "float32"},
        "action": {"argmax": True, "dtype": "int64"},
    },
    "rules": [
        {"name": "finite", "field": "obs", "finite": True},
        {"name": "range", "field": "obs", "range": [-5, 5]},
    ],
    "outliers": [{"field": "obs", "z": 6, "min_count": 500}],
    "tags": {"origin": "noisy"},
}


def expert(obs: np.ndarray) -> int:
    return int(obs @ EXPERT > 0)


def record_expert(namespace: str, episodes: int) -> None:
    with Ingestor(namespace) as ingestor:
        env = RecordSteps(gym.make("CartPole-v1"), ingestor, origin="expert")
        for ep in range(episodes):
            obs, _ = env.reset(seed=ep)
            done = False
            while not done:
                obs, _, terminated, truncated, _ = env.step(expert(obs))
                done = terminated or truncated


def record_noisy(namespace: str, episodes: int, rng: np.random.Generator) -> dict[str, int]:
    """The second demonstrator's log in its own format (committed as it is, the way an
    import of another system's data lands), with a broken sensor; returns its steps and
    the broken ones by kind (``nan``: a NaN reading, ``range``: a reading of 1,000)."""
    env, store = gym.make("CartPole-v1"), Store(get_settings().redis_url, namespace)
    bad = {"steps": 0, "nan": 0, "range": 0}
    for ep in range(episodes):
        obs, _ = env.reset(seed=1000 + ep)
        states, actions, rewards, done = [], [], [], False
        while not done:
            action = expert(obs)
            state = obs[::-1].astype(np.float64) * 10.0
            glitch = rng.random()
            if glitch < 0.02:
                state[1], bad["nan"] = np.nan, bad["nan"] + 1
            elif glitch < 0.03:
                state[0], bad["range"] = 1e3, bad["range"] + 1
            obs, reward, terminated, truncated, _ = env.step(action)
            states.append(state)
            actions.append(np.eye(2, dtype=np.float32)[action])
            rewards.append(reward)
            done = terminated or truncated
        n = len(states)
        bad["steps"] += n
        store.commit(
            StepBatch(
                episode=StrColumn.of([f"noisy-{ep}"] * n),
                step_index=np.arange(n),
                reward=np.asarray(rewards, np.float32),
                terminated=np.arange(n) == n - 1,
                truncated=np.zeros(n, bool),
                fields={"state": np.stack(states), "act": np.stack(actions)},
            )
        )
    return bad


class Learner:
    """Logistic regression on the 4 state features, standardised by the namespace's global
    statistics (the ones the BC batches were normalised with): P(push right)."""

    def __init__(self, stats: RunningStats) -> None:
        self.w, self.b = np.zeros(4), 0.0
        self.version = stats.count
        self.mean, self.scale = stats.mean, 1 / np.sqrt(stats.var + 1e-8)

    def normalise(self, obs: np.ndarray) -> np.ndarray:
        return (np.asarray(obs, np.float64) - self.mean) * self.scale

    def act(self, obs: np.ndarray) -> int:
        return int(self.normalise(obs) @ self.w + self.b > 0)

    def fit(self, x: np.ndarray, action: np.ndarray, lr: float = 2.0) -> float:
        """One gradient step on standardised states ``x``; returns the batch accuracy."""
        y = np.asarray(action, np.float64)
        p = 1 / (1 + np.exp(-(x @ self.w + self.b)))
        self.w -= lr * x.T @ (p - y) / len(x)
        self.b -= lr * float((p - y).mean())
        return float(np.mean((p > 0.5) == (y > 0.5)))


def evaluate(policy: Learner, episodes: int) -> float:
    env, total = gym.make("CartPole-v1"), 0.0
    for ep in range(episodes):
        obs, _ = env.reset(seed=5000 + ep)
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(policy.act(obs))
            total += reward
            done = terminated or truncated
    return total / episodes


def play(namespace: str, policy: Learner, episodes: int, seed: int) -> None:
    """The learner's own rollouts, recorded (DAgger's state distribution)."""
    with Ingestor(namespace) as ingestor:
        env = RecordSteps(gym.make("CartPole-v1"), ingestor, origin="learner")
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            done = False
            while not done:
                obs, _, terminated, truncated, _ = env.step(policy.act(obs))
                done = terminated or truncated


SIZES = {
    # expert and noisy episodes, BC updates, DAgger rounds (of `dagger` updates each, the
    # learner playing `plays` episodes first), evaluation episodes
    "full": {
        "expert": 20,
        "noisy": 10,
        "bc": 400,
        "rounds": 4,
        "dagger": 200,
        "plays": 5,
        "eval": 10,
    },
    "short": {"expert": 4, "noisy": 2, "bc": 20, "rounds": 1, "dagger": 10, "plays": 1, "eval": 3},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="imitation")
    p.add_argument("--short", action="store_true", help="a small run (CI): the bookkeeping")
    args = p.parse_args()
    ns, url = args.namespace, get_settings().redis_url
    size = SIZES["short" if args.short else "full"]
    rng, began = np.random.default_rng(0), time.monotonic()
    summary: dict = {"mode": "short" if args.short else "full"}
    phases: dict[str, float] = {}

    def phase(name: str, since: float) -> float:
        now = time.monotonic()
        phases[name] = round(phases.get(name, 0.0) + now - since, 2)
        return now

    t = began
    record_expert(ns, size["expert"])
    recorded = record_noisy(f"{ns}-raw", size["noisy"], rng)
    t = phase("record", t)
    target = Store(url, ns)
    define_source(target, "noisy", {**CLEANING, "namespace": f"{ns}-raw"})
    for name, spec in sources(target).items():
        clean_source(target, name, spec, budget_s=60)
    # Distances in standard deviations: x and its velocity would drown the pole's angle.
    stats = namespace_stats(target.r, target.owned_key("")).get("obs")
    weights = (1 / np.sqrt(stats.var + 1e-8)).tolist()
    define_index(target, {"field": "obs", "kind": "exact", "weights": weights}, replace=True)
    update_indexes(target, budget_s=60)
    t = phase("clean_and_index", t)
    counts = quarantined(target)
    quarantine = target.count("tags.origin == 'noisy' and not trainable")
    kept = counts.get("noisy:steps", 0) - quarantine
    print(f"cleaning: {counts} ({recorded} recorded; {kept} noisy steps kept)")
    summary["recorded"], summary["counts"], summary["quarantined"] = recorded, counts, quarantine
    summary["expert_steps"] = target.count("tags.origin == 'expert'")

    learner, client = Learner(stats), BatchClient(ns)
    learner_ns = BatchClient(f"{ns}-learner")
    served = {"bc_batches": 0, "bad_rows": 0, "other_version": 0, "dagger_batches": 0}
    try:
        client.register(
            {
                "name": "bc",
                "batch_size": 256,
                "fields": ["obs", "action"],
                "sources": [{"name": "all", "where": "tags.origin in ['expert', 'noisy']"}],
                "augment": {"obs": [{"running_normalize": {"scope": "namespace"}}]},
                "prefetch": {"depth": 8},
            }
        )

        def bc_step() -> float:
            batch = client.pop("bc", timeout=60)
            served["bc_batches"] += 1
            served["other_version"] += int((batch["stats_version.obs"] != learner.version).sum())
            raw = target.get(batch.ids, fields=["obs"])["obs"]  # as stored: none of them bad
            served["bad_rows"] += int((~np.isfinite(raw) | (np.abs(raw) > 5)).any(axis=1).sum())
            return learner.fit(batch["obs"], batch["action"])

        for _ in range(size["bc"]):
            accuracy = bc_step()
        t = phase("bc", t)
        bc_return = evaluate(learner, size["eval"])
        t = phase("evaluate", t)
        print(f"BC: {size['bc']} updates, batch accuracy {accuracy:.2f}, return {bc_return:.1f}")
        summary["bc_return"], rounds = bc_return, []
        for r in range(size["rounds"]):
            play(f"{ns}-learner", learner, size["plays"], seed=100 * (r + 1))
            t = phase("play", t)
            learner_ns.register(
                {
                    "name": "dagger",
                    "batch_size": 128,
                    "fields": ["obs"],
                    "sources": [{"name": "learner"}],
                    "nearest": {
                        "namespace": ns,
                        "k": 5,
                        "where": "tags.origin == 'expert'",
                        "fields": ["action"],
                    },
                    "seed": r,  # a new version each round: no batches of the last round
                }
            )
            agree, shapes = [], set()
            for _ in range(size["dagger"]):
                # DAgger aggregates: the demonstrations, then the learner's relabelled states.
                bc_step()
                batch = learner_ns.pop("dagger", timeout=60)
                served["dagger_batches"] += 1
                shapes.add(batch["nearest.action"].shape)
                votes = batch["nearest.action"].mean(axis=1)
                sure = (votes == 0) | (votes == 1)  # the k nearest expert steps agree
                labels = (votes > 0.5).astype(np.int64)
                if sure.any():
                    learner.fit(learner.normalise(batch["obs"][sure]), labels[sure], lr=0.5)
                agree.append(np.mean(labels[sure] == (batch["obs"][sure] @ EXPERT > 0)))
            t = phase("dagger", t)
            ret = evaluate(learner, size["eval"])
            t = phase("evaluate", t)
            rounds.append({"agree": round(float(np.mean(agree)), 3), "return": ret})
            summary["nearest_shapes"] = sorted(shapes)
            print(
                f"DAgger round {r + 1}: the labels of states whose nearest expert steps agree "
                f"match the expert on {np.mean(agree):.0%}; return {ret:.1f}"
            )
        summary["rounds"] = rounds
    finally:
        client.close()
        learner_ns.close()
    final = evaluate(learner, size["eval"])
    phase("evaluate", t)
    print(f"final return {final:.1f}")
    summary.update(served, final_return=final, seconds=phases)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""What a data-quality pass costs (``claw.maintenance.quality``): a cold pass, a pass after
new steps, and one after priority updates only.

    .venv/bin/python bench/quality.py [--steps 1000000]

Starts a private redis-server and fills a namespace through ``Store.commit`` (not timed):
``--steps`` steps of a float32[8] obs and an int64 action, 1,000-step episodes, two tasks
and three skills. Then times ``quality_namespace``: cold (every chunk: the index built,
every payload chunk read), after 10,000 more steps (their chunks only), after 100,000
priority updates (their chunks' metadata only: the payload statistics stand), and with
nothing changed.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from claw_tasks.connection.client import redis_client
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch, StrColumn
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from orchestrator.maintenance.quality import quality_namespace

BATCH = 50_000


def commit(store: Store, rng: np.random.Generator, n: int, tag: str) -> np.ndarray:
    b = StepBatch(
        episode=StrColumn.of([f"{tag}-{i // 1000}" for i in range(n)]),
        step_index=np.arange(n) % 1000,
        reward=rng.random(n, np.float32),
        terminated=np.arange(n) % 1000 == 999,
        truncated=np.zeros(n, bool),
        fields={"obs": rng.random((n, 8), np.float32), "action": rng.integers(0, 4, n)},
        strs={
            "task_id": StrColumn.of([("reach", "grasp")[i % 2] for i in range(n)]),
            "skill_tag": StrColumn.of([("walk", "run", "jump")[i % 3] for i in range(n)]),
        },
    )
    return store.commit(b).ids


def timed(label: str, store: Store) -> None:
    t = time.perf_counter()
    quality_namespace(store)
    print(f"{label}: {time.perf_counter() - t:.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with RedisServer() as server:
        store = Store(redis_client(server.url), "bench")
        schema = Schema(fields={"obs": FieldSpec("<f4", (8,)), "action": FieldSpec("<i8", ())})
        store.create(capacity=2 * args.steps, schema=schema)
        ids = np.concatenate(
            [commit(store, rng, BATCH, f"e{k}") for k in range(-(-args.steps // BATCH))]
        )
        print(f"{len(ids):,} steps; load {os.getloadavg()[0]:.1f}")
        timed("cold pass (index built, every chunk)", store)
        commit(store, rng, 10_000, "new")
        timed("after 10,000 new steps", store)
        pick = rng.choice(ids, 100_000, replace=False)
        store.update_priorities(pick, rng.random(len(pick), np.float32))
        timed("after 100,000 priority updates (spread over every chunk)", store)
        timed("nothing changed", store)


if __name__ == "__main__":
    main()

"""Offline and online experience in one recipe: an archive restored beside fresh steps.

Yesterday's steps are archived to Parquet and restored into today's namespace (restore
keeps each step's archived id as the numeric tag ``orig_id``); today's agent records new
steps there through ``RecordSteps``. One recipe draws half of every batch from each:
``tags.orig_id >= 0`` holds for restored steps only (a missing tag matches no
comparison), ``not tags.orig_id >= 0`` for the fresh ones. Needs a running stack:

    claw up                                   # in another terminal
    python examples/offline_online.py --archive /tmp/claw-archive
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import gymnasium as gym
import numpy as np

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator import BatchClient
from orchestrator.maintenance.archive import archive_namespace
from orchestrator.maintenance.restore import restore


def record(namespace: str, agent: str, steps: int, seed: int) -> None:
    with Ingestor(namespace) as ingestor:
        env = RecordSteps(gym.make("CartPole-v1"), ingestor, task_id="balance", agent_id=agent)
        env.reset(seed=seed)
        env.action_space.seed(seed)
        for _ in range(steps):
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="offline-online")
    p.add_argument("--archive", type=Path, required=True, help="a directory for the Parquet files")
    p.add_argument("--steps", type=int, default=2000, help="steps recorded each day")
    p.add_argument("--batches", type=int, default=3)
    args = p.parse_args()
    url = get_settings().redis_url

    yesterday = f"{args.namespace}-yesterday"
    record(yesterday, "yesterday", args.steps, seed=0)
    archived = archive_namespace(Store(url, yesterday), args.archive)
    print(f"archived {archived.rows} steps of {yesterday!r} to {args.archive}")
    restored = restore(args.archive / f"ns={yesterday}", Store(url, args.namespace))
    print(f"restored {restored.rows} steps into {args.namespace!r}")
    record(args.namespace, "today", args.steps, seed=1)

    client = BatchClient(args.namespace)
    client.register(
        {
            "name": "half-half",
            "batch_size": 64,
            "fields": ["obs", "action", "reward", "next_obs", "agent_id", "tags.orig_id"],
            "sources": [
                {"name": "offline", "weight": 0.5, "where": "tags.orig_id >= 0"},
                {"name": "online", "weight": 0.5, "where": "not tags.orig_id >= 0"},
            ],
        }
    )
    for _ in range(args.batches):
        batch = client.pop("half-half", timeout=60.0)
        by_source = Counter(batch.sources[i] for i in batch.source_index.tolist())
        agents = Counter(batch.meta["agent_id"])
        restored_rows = int(np.isfinite(batch["tags.orig_id"]).sum())
        print(
            f"batch of {len(batch.ids)}: sources {dict(sorted(by_source.items()))}, agents "
            f"{dict(sorted(agents.items()))}, {restored_rows} rows with an orig_id"
        )
    client.close()


if __name__ == "__main__":
    main()

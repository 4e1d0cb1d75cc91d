"""Load run: 4 producer processes and 2 trainer processes against real workers.

    .venv/bin/python bench/load.py [--duration 600] [--producers 4] [--trainers 2]
                                   [--json report.json]

A private redis-server (store and broker), one Celery worker on ``ingest`` and one on
``prefetch`` (prefork, concurrency 2 and 1). Producers add vector steps (obs float32[8],
100-step episodes) through ``Ingestor`` as fast as they can for ``--duration`` seconds,
then close (which waits for the store's confirmation). Trainers pop 256-step batches of a
uniform recipe through ``BatchClient`` for as long. The namespace is a 1,048,576-step ring,
so memory stays bounded however long the run.

Reports committed steps/s, pops/s, pop latency p50/p99, Redis ``used_memory`` over time,
and checks the counts exactly: steps inserted (the shards' sequence counters) equal steps
produced, and in the ring no (episode, step_index) twice, every episode's step_index a
contiguous run ending at 99. Exits 1 if a count is off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator.cli.devstack import DevStack, worker_service
from orchestrator.delivery.client import BatchClient

NAMESPACE = "load"
CAPACITY = 1 << 20
EPISODE_LEN = 100
RECIPE = {
    "name": "load",
    "batch_size": 256,
    "fields": ["obs", "action", "reward"],
    "sources": [{"name": "all"}],
    "prefetch": {"depth": 8},
}


def produce(url: str, index: int, start: Any, duration: float) -> dict[str, int]:
    """One producer process: whole episodes for ``duration`` s after every process is up
    (``start``, a barrier), then close (which waits for the store's confirmation)."""
    ing = Ingestor(NAMESPACE, url, flush_steps=2048, flush_interval=0.5)
    rng = np.random.default_rng(index)
    obs = rng.normal(size=(EPISODE_LEN, 8)).astype(np.float32)
    start.wait()
    deadline = time.time() + duration
    produced = episodes = 0
    while time.time() < deadline:
        with ing.episode(episode_id=f"p{index}-e{episodes}") as ep:
            for t in range(EPISODE_LEN):
                ep.add(obs[t], np.int64(t % 4), float(t), terminated=t == EPISODE_LEN - 1)
        produced += EPISODE_LEN
        episodes += 1
    res = ing.close(timeout=600)
    return {
        "produced": produced,
        "committed": res.committed,
        "rejected": res.rejected,
        "pending": res.pending,
    }


def train(url: str, start: Any, duration: float) -> dict[str, Any]:
    """One trainer process: pop batches for ``duration`` s; latency of each pop but the
    first (which waits for the first data)."""
    client = BatchClient(NAMESPACE, url)
    client.register(RECIPE)
    start.wait()
    deadline = time.time() + duration
    client.pop("load", timeout=120)
    latencies = []
    while time.time() < deadline:
        t0 = time.perf_counter()
        batch = client.pop("load", timeout=120)
        latencies.append(time.perf_counter() - t0)
        assert len(batch.ids) == RECIPE["batch_size"]
    client.close()
    return {"latencies": latencies}


def check_ring(store: Store, produced: int) -> list[str]:
    """Exactness of the ring after the run: what is wrong (empty when all is right)."""
    errors = []
    inserted = sum(store.seqs())
    if inserted != produced:
        errors.append(f"{inserted} steps inserted, {produced} produced")
    cols = store.meta_columns(0, ["episode", "step_index"])
    alive = cols["alive"]
    if int(alive.sum()) != min(store.config().cap, produced):
        errors.append(f"{int(alive.sum())} steps alive, expected {min(CAPACITY, produced)}")
    ep, idx = cols["episode"][alive], cols["step_index"][alive].astype(np.int64)
    order = np.lexsort((idx, ep))
    ep, idx = ep[order], idx[order]
    same = ep[1:] == ep[:-1]
    if (same & (idx[1:] == idx[:-1])).any():
        errors.append("a step_index appears twice in an episode")
    if (same & (idx[1:] != idx[:-1] + 1)).any():
        errors.append("an episode's step_index has a gap")
    last = np.append(~same, True)  # the last row of each episode
    if (idx[last] != EPISODE_LEN - 1).any():
        errors.append("an episode does not end at its last step")
    return errors


def _memory_sampler(store: Store, out: list[tuple[float, int]], stop: threading.Event) -> None:
    t0 = time.time()
    while not stop.wait(1.0):
        out.append((time.time() - t0, int(store.r.info("memory")["used_memory"])))


def run(duration: float, producers: int, trainers: int, log_dir: Path) -> dict[str, Any]:
    with RedisServer() as server, DevStack(log_dir) as stack:
        stack.start_redis(server.url)
        stack.start(
            [
                worker_service(log_dir, ["ingest"], 2, quick=True),
                worker_service(log_dir, ["prefetch"], 1, quick=True),
            ]
        )
        Ingestor(NAMESPACE, server.url, capacity=CAPACITY, flush_interval=None).close()
        store = Store(server.url, NAMESPACE)
        memory: list[tuple[float, int]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_memory_sampler, args=(store, memory, stop))
        ctx = get_context("spawn")
        with (
            ctx.Manager() as manager,
            ProcessPoolExecutor(producers + trainers, mp_context=ctx) as pool,
        ):
            start = manager.Barrier(producers + trainers + 1)
            made = [pool.submit(produce, server.url, i, start, duration) for i in range(producers)]
            popped = [pool.submit(train, server.url, start, duration) for _ in range(trainers)]
            start.wait(timeout=300)
            load_before = os.getloadavg()
            t0 = time.time()
            sampler.start()
            results = [f.result() for f in made]
            lat = np.concatenate([f.result()["latencies"] for f in popped] + [np.zeros(0)])
        confirmed_at = time.time() - t0
        stop.set()
        sampler.join()
        produced = sum(r["produced"] for r in results)
        errors = check_ring(store, produced)
        if sum(r["committed"] for r in results) != produced:
            errors.append(f"producers confirmed {sum(r['committed'] for r in results)} steps")
        if any(r["rejected"] or r["pending"] for r in results):
            errors.append(f"rejected or pending steps: {results}")
        return {
            "duration_s": duration,
            "confirmed_after_s": round(confirmed_at, 1),
            "producers": producers,
            "trainers": trainers,
            "produced_steps": produced,
            "committed_steps_per_s": round(produced / confirmed_at),
            "pops": len(lat),
            "pops_per_s": round(len(lat) / duration, 1),
            "pop_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2) if len(lat) else None,
            "pop_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2) if len(lat) else None,
            "redis_used_memory_mb": [(round(t), round(m / 2**20, 1)) for t, m in memory],
            "loadavg_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, python "
            f"{platform.python_version()}",
            "errors": errors,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the report here too")
    p.add_argument("--log-dir", type=Path, help="worker logs (default: a temp dir)")
    args = p.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="claw-load-"))
    report = run(args.duration, args.producers, args.trainers, log_dir)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    sys.exit(1 if report["errors"] else 0)


if __name__ == "__main__":
    main()

"""Maintenance at scale: evicting N steps by TTL, and one priority recomputation pass.

A private redis-server holds N vector steps (obs float32[8], action int64, 100-step
episodes, 4 task ids), filled with big ``Store.commit`` batches, all committed an hour
"ago" except the newest 1 %. Then:

- evict: a retention policy ``max_age 30m`` and one ``evict_namespace`` call (what one beat
  tick of ``claw.maintenance.evict`` runs): cold index build, the choice, and every
  ``evict.lua`` call (64 steps each). Redis records every command in SLOWLOG
  (``slowlog-log-slower-than 0``) during it: the script's calls (median, p99, longest)
  and the longest single call of any kind.
- recompute: a second namespace of N steps, one whole pass of ``Recompute`` with a
  vectorised scorer over metadata (``|reward| + 0.01``) plus half-life decay, clamp and
  normalisation; again with the longest single Redis call.

Run: ``.venv/bin/python bench/maintenance.py [--steps 1000000] [--realtime]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from claw_tasks.store.retention import Retention
from claw_tasks.store.scripts import Lua
from orchestrator.maintenance.evict import evict_namespace
from orchestrator.maintenance.lifecycle import forget
from orchestrator.maintenance.priorities import Recompute, Rules

TASKS = ["grasp", "reach", "lift", "push"]
EPISODE = 100
BATCH = 16376 * 4


def steps(start: int, n: int, rng: np.random.Generator) -> StepBatch:
    i = np.arange(start, start + n)
    ep, t = i // EPISODE, i % EPISODE
    first = int(ep[0])
    return StepBatch(
        episode=StrColumn([f"ep{e}" for e in range(first, int(ep[-1]) + 1)], ep - first),
        step_index=t,
        reward=rng.uniform(-1, 1, n).astype(np.float32),
        terminated=t == EPISODE - 1,
        truncated=np.zeros(n, bool),
        fields={"obs": rng.standard_normal((n, 8), dtype=np.float32), "action": t % 4},
        priority=rng.uniform(0.01, 1.0, n).astype(np.float32),
        strs={"task_id": StrColumn(TASKS, (ep % 4).astype(np.int32))},
    )


def fill(url: str, ns: str, n: int, old_until: int, now: float) -> Store:
    store = Store(url, ns)
    store.create(capacity=n)
    rng = np.random.default_rng(0)
    for start in range(0, n, BATCH):
        k = min(BATCH, n - start)
        store.commit(steps(start, k, rng), now=now - 3600 if start < old_until else now)
    return store


def calls(r, script: str) -> str:
    """What SLOWLOG recorded since its reset: the script's calls (median, p99, longest) and
    the longest call of any kind (with its command)."""
    entries = [e for e in r.slowlog_get(200_000) if not e["command"].startswith(b"SLOWLOG")]
    entries.sort(key=lambda e: -e["duration"])
    if os.environ.get("BENCH_VERBOSE"):
        for e in entries[:8]:
            print("  ", e["duration"], e["command"][:150])
    sha = Lua(script).sha.encode()
    mine = np.array([e["duration"] for e in entries if sha in e["command"][:60]]) / 1e3
    top = entries[0]
    name = " ".join(top["command"].decode(errors="replace").split()[:1])
    if sha in top["command"][:60]:
        name = f"{script}.lua"
    return (
        f"{script}.lua: {len(mine):,} calls, median {np.median(mine):.2f} ms, p99 "
        f"{np.percentile(mine, 99):.2f} ms, longest {mine.max():.2f} ms; longest of all "
        f"{len(entries):,} calls {top['duration'] / 1e3:.2f} ms ({name})"
    )


def score(chunk: dict[str, np.ndarray], params: dict) -> np.ndarray:
    """A vectorised scorer over metadata."""
    return np.abs(chunk["reward"].astype(np.float64)) + 0.01


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument(
        "--realtime",
        action="store_true",
        help="run redis-server SCHED_FIFO (needs root): its calls' durations are "
        "then their own work, not time spent waiting for a core on a busy host",
    )
    args = ap.parse_args()
    n = args.steps
    now = time.time()
    old = (n - n // 100) // BATCH * BATCH
    print(f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    with RedisServer(options={"slowlog-max-len": "200000"}) as srv:
        r = srv.client()
        if args.realtime:
            pid = int(r.info("server")["process_id"])
            os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(10))
            print(f"redis-server {pid} runs SCHED_FIFO 10")
        t = time.perf_counter()
        store = fill(srv.url, "bench-evict", n, old, now)
        print(f"filled {n:,} steps in {time.perf_counter() - t:.1f} s")
        store.set_retention(Retention(max_age=1800))
        r.config_set("slowlog-log-slower-than", 0)
        r.slowlog_reset()
        t = time.perf_counter()
        counts = evict_namespace(store, now=now)
        wall = time.perf_counter() - t
        seen = calls(r, "evict")
        r.config_set("slowlog-log-slower-than", 10000)
        print(
            f"evict: {counts['ttl']:,} steps in {wall:.2f} s "
            f"({counts['ttl'] / wall:,.0f} steps/s); {seen}"
        )
        assert store.count() == n - old
        forget("bench-evict")

        rstore = fill(srv.url, "bench-prio", n, n, now)
        rules = Rules.of(
            {
                "scorer": "bench.maintenance:score",
                "half_life": "1h",
                "clamp": [0.01, 10],
                "normalize": True,
            }
        )
        job = Recompute(rstore, rules, allowed=("bench.maintenance:score",))
        r.config_set("slowlog-log-slower-than", 0)
        r.slowlog_reset()
        t = time.perf_counter()
        out = job.run(budget_s=3600, now=now + 600)
        wall = time.perf_counter() - t
        seen = calls(r, "reprioritize")
        r.config_set("slowlog-log-slower-than", 10000)
        assert out["finished"]
        print(
            f"recompute: {out['written']:,} priorities in {wall:.2f} s "
            f"({out['written'] / wall:,.0f} steps/s); {seen}"
        )
        print(f"load average during the run: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""Maintenance at scale: evicting N steps by TTL, and one priority recomputation pass.

A private redis-server holds N vector steps (obs float32[8], action int64, 100-step
episodes, 4 task ids), filled with big ``Store.commit`` batches, all committed an hour
"ago" except the newest 1 %. Then:

- evict: a retention policy ``max_age 30m`` and one ``evict_namespace`` call (what one beat
  tick of ``claw.maintenance.evict`` runs): cold index build, the choice, and every
  ``evict.lua`` call (64 steps each). Redis records every command in SLOWLOG
  (``slowlog-log-slower-than 0``) during it: the script's calls (median, p99, longest,
  how many over 5 ms) and the longest call of each command. Then the control: as many
  calls of a Lua loop that only adds numbers (no Redis command, no allocation), as long as
  the median eviction call: what this machine does to a call that is no work of ours
  (on a VM, time the hypervisor runs something else shows in any call's duration).
- recompute: a second namespace of N steps, one whole pass of ``Recompute`` with a
  vectorised scorer over metadata (``|reward| + 0.01``) plus half-life decay, clamp and
  normalisation; again with the longest call of each command.

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
from claw_tasks.store.changes import LOG_SINCE, REREAD
from claw_tasks.store.retention import Retention
from claw_tasks.store.scripts import Lua
from claw_tasks.worker.context import forget
from orchestrator.maintenance.evict import evict_namespace
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


CONTROL = "local x = 0; for i = 1, tonumber(ARGV[1]) do x = x + i % 7 end; return x"


def calls(r, script: str) -> tuple[str, np.ndarray]:
    """What SLOWLOG recorded since its reset: the script's calls (median, p99, longest, over
    5 ms), the longest call of each command (scripts by name); and the script's durations
    (ms)."""
    entries = [e for e in r.slowlog_get(2_000_000) if not e["command"].startswith(b"SLOWLOG")]
    names = {Lua(s).sha.encode(): f"{s}.lua" for s in (script, "evict", "update")}
    names[LOG_SINCE.sha.encode()] = "log_since.lua"
    names[REREAD.sha.encode()] = "reread.lua"
    longest: dict[str, float] = {}
    mine = []
    for e in entries:
        words = e["command"].split(b" ", 2)
        name = words[0].decode(errors="replace")
        if name == "EVALSHA" and len(words) > 1:
            name = names.get(words[1], "EVALSHA")
        longest[name] = max(longest.get(name, 0.0), e["duration"] / 1e3)
        if name == f"{script}.lua":
            mine.append(e["duration"] / 1e3)
    d = np.array(mine)
    top = sorted(longest.items(), key=lambda kv: -kv[1])[:6]
    return (
        f"{script}.lua: {len(d):,} calls, median {np.median(d):.2f} ms, p99 "
        f"{np.percentile(d, 99):.2f} ms, longest {d.max():.2f} ms, {(d > 5).sum()} over 5 ms; "
        f"longest of each command ({len(entries):,} calls): "
        + ", ".join(f"{k} {v:.2f}" for k, v in top)
    ), d


def control(r, like: np.ndarray) -> str:
    """``len(like)`` calls of :data:`CONTROL` as long as ``like``'s median (ms), SLOWLOG's
    durations of them."""
    sha = r.script_load(CONTROL)
    loops = 20_000
    for _ in range(4):  # tune the loop to the median
        r.config_set("slowlog-log-slower-than", 0)
        r.slowlog_reset()
        for _ in range(50):
            r.evalsha(sha, 0, loops)
        took = np.median([e["duration"] for e in r.slowlog_get(100) if b"EVALSHA" in e["command"]])
        loops = max(1, int(loops * np.median(like) * 1e3 / took))
    r.slowlog_reset()
    for _ in range(len(like)):
        r.evalsha(sha, 0, loops)
    got = r.slowlog_get(len(like) + 100)
    r.config_set("slowlog-log-slower-than", 10000)
    d = np.array([e["duration"] for e in got if b"EVALSHA" in e["command"]]) / 1e3
    return (
        f"control (a Lua loop of {loops:,} additions): {len(d):,} calls, median "
        f"{np.median(d):.2f} ms, p99 {np.percentile(d, 99):.2f} ms, longest {d.max():.2f} ms, "
        f"{(d > 5).sum()} over 5 ms"
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
    with RedisServer(options={"slowlog-max-len": "2000000"}) as srv:
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
        seen, durations = calls(r, "evict")
        r.config_set("slowlog-log-slower-than", 10000)
        print(
            f"evict: {counts['ttl']:,} steps in {wall:.2f} s "
            f"({counts['ttl'] / wall:,.0f} steps/s); {seen}"
        )
        print(control(r, durations))
        assert store.count() == n - old
        forget("bench-evict", dropped=False)

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
        seen, _ = calls(r, "reprioritize")
        r.config_set("slowlog-log-slower-than", 10000)
        assert out["finished"]
        print(
            f"recompute: {out['written']:,} priorities in {wall:.2f} s "
            f"({out['written'] / wall:,.0f} steps/s); {seen}"
        )
        print(f"load average during the run: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""What lineage costs: per batch (the trainer's encoding, Redis memory per entry, the index
the beat builds), and the queries with the index against a scan of the whole log.

    .venv/bin/python bench/lineage.py [--entries 100000] [--batch 256] [--steps 1000000]

Starts a private redis-server and appends ``--entries`` entries (as ``BatchClient`` does:
``XADD MAXLEN ~`` queued on a pipeline) of ``--batch`` ids drawn uniformly from
``--steps`` ids (the worst case for the index's blocks: every batch spreads over the whole
namespace), in draw order, a new policy every 100 batches. The trainer's encoding and the
memory per entry are measured in the same run for three entries of the same batches: the
ids alone (an entry without the replay fields), and with what replays the batch (order,
weights, seed, recipe digest: :mod:`orchestrator.inspect.replay`) with equal weights
(uniform sampling) and with prioritized ones (PER's ``(N P)^-beta / max``, priorities
``|N(0,1)| + 0.001``, alpha 0.6, beta 0.4); the log of the index and query figures holds
the prioritized ones. Then one index pass over the whole log (what
the beat does every 30 s, here all at once), timed, with the index's ``MEMORY USAGE``.
Then each query, best of ``--repeat``, with the index and as a scan of the whole log (the
code before the index, kept here as the reference): "which data trained policy v", "which
policies trained on step s", and on an episode (40 steps of consecutive ids), with the
Redis round trips each made (``INFO stats``' ``total_commands_processed`` is not round
trips: pipelines are counted by the client here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from claw_tasks.connection.client import redis_client
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from claw_tasks.store.usage import key_bytes
from orchestrator.delivery.lineage import LineageLog, Replayable, decode_ids, record


def scan_trained(log: LineageLog, policy: str) -> list[str]:
    """The query before the index: every page of the log, the policy compared first."""
    want, out, low = policy.encode(), [], "-"
    while True:
        page = log.r.xrange(log.key, low, "+", count=1000)
        out += [i.decode() for i, kv in page if kv.get(b"p") == want]
        if len(page) < 1000:
            return out
        low = "(" + page[-1][0].decode()


def scan_policies(log: LineageLog, ids: np.ndarray) -> dict[int, dict[str, int]]:
    """The query before the index: every entry decoded, a page of them per ``isin``."""
    ids = np.unique(ids)
    out: dict[int, dict[str, int]] = {int(i): {} for i in ids}
    low = "-"
    while True:
        page = log.r.xrange(log.key, low, "+", count=1000)
        rows = [decode_ids(kv[b"ids"]) for _, kv in page]
        names = [kv[b"p"].decode() for _, kv in page]
        if rows:
            flat = np.concatenate(rows)
            owner = np.repeat(np.arange(len(rows)), [len(x) for x in rows])
            hit = np.flatnonzero(np.isin(flat, ids))
            for step, k in zip(flat[hit].tolist(), owner[hit].tolist(), strict=True):
                out[step][names[k]] = out[step].get(names[k], 0) + 1
        if len(page) < 1000:
            return out
        low = "(" + page[-1][0].decode()


class Trips:
    """Counts round trips: every ``execute_command`` outside a pipeline, every pipeline
    ``execute``."""

    def __init__(self, r: Any) -> None:
        self.n = 0
        self.r = r
        one, pipe_cls = r.execute_command, r.pipeline

        def command(*a: Any, **k: Any) -> Any:
            self.n += 1
            return one(*a, **k)

        def pipeline(*a: Any, **k: Any) -> Any:
            p = pipe_cls(*a, **k)
            run = p.execute

            def execute(*ea: Any, **ek: Any) -> Any:
                self.n += 1
                return run(*ea, **ek)

            p.execute = execute
            return p

        r.execute_command, r.pipeline = command, pipeline


def best(f: Callable[[], Any], repeat: int, trips: Trips) -> tuple[float, Any, int]:
    times, got = [], None
    for _ in range(repeat):
        before = trips.n
        t = time.perf_counter()
        got = f()
        times.append(time.perf_counter() - t)
        used = trips.n - before
    return min(times), got, used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = [rng.integers(1, args.steps + 1, args.batch) for _ in range(1000)]
    prio = (np.abs(rng.standard_normal(args.steps)) + 1e-3) ** 0.6
    total = prio.sum()
    variants: dict[str, list[Replayable | None]] = {"ids only": [None] * len(batches)}
    variants["replayable, equal weights"] = [
        Replayable(np.ones(args.batch, np.float32), None, int(rng.integers(2**63)), "0" * 16)
        for _ in batches
    ]
    weighted = []
    for ids in batches:
        w = (args.steps * prio[ids - 1] / total) ** -0.4
        seed = int(rng.integers(2**63))
        weighted.append(Replayable((w / w.max()).astype(np.float32), None, seed, "0" * 16))
    variants["replayable, prioritized weights"] = weighted
    with RedisServer() as server:
        r = redis_client(server.url)
        # Each call timed alone, the variants interleaved call by call, the median kept:
        # a loaded machine preempts some calls, and a loop's mean carries them.
        times: dict[str, list[int]] = {what: [] for what in variants}
        for _ in range(args.repeat):
            for k, ids in enumerate(batches):
                for what, extra in variants.items():
                    t = time.perf_counter_ns()
                    record("r", 1, k // 100, ids, None, extra[k])
                    times[what].append(time.perf_counter_ns() - t)
        for what, extra in variants.items():
            cost = statistics.median(times[what]) / 1e9
            side = LineageLog(Store(r, f"side-{len(what)}"), maxlen=len(batches))
            with r.pipeline(transaction=False) as pipe:
                for k, ids in enumerate(batches):
                    side.queue(pipe, record("r", 1, k // 100, ids, None, extra[k]))
                pipe.execute()
            size = int(r.memory_usage(side.key, samples=0) or 0) / side.length()
            r.delete(side.key)
            print(
                f"{what}: trainer {cost * 1e6:.1f} µs to encode a batch's entry (median of "
                f"{len(times[what]):,} calls), Redis {size:,.0f} B per entry"
            )
        store = Store(r, "bench")
        log = LineageLog(store, maxlen=args.entries)
        t = time.time()
        for at in range(0, args.entries, 1000):
            with r.pipeline(transaction=False) as pipe:
                for k in range(at, min(at + 1000, args.entries)):
                    j = k % len(batches)
                    log.queue(pipe, record("r", 1, k // 100, batches[j], None, weighted[j]))
                pipe.execute()
        filled = time.time() - t
        used = int(r.memory_usage(log.key, samples=0) or 0)
        n = log.length()
        cpu = time.process_time()
        built = log.build_index(force=True)
        cpu = time.process_time() - cpu
        index_keys = [k for k in r.scan_iter(match=f"{log.key}:*")]
        index_bytes = sum(key_bytes(r, index_keys))
        print(
            f"{n:,} entries of {args.batch} ids from {args.steps:,} steps "
            f"(appended in {filled:.0f} s); load {os.getloadavg()[0]:.1f}"
        )
        print(
            f"Redis: {used / n:,.0f} B per entry ({used / n / args.batch:.2f} B per row), "
            f"{used / 2**20:,.1f} MiB in all"
        )
        print(
            f"index pass: {built.segments} segments, {built.seconds:.1f} s wall, {cpu:.1f} s "
            f"CPU ({cpu / n * 1e6:.0f} µs an entry); MEMORY USAGE {index_bytes / n:,.0f} B per "
            f"entry ({index_bytes / n / args.batch:.2f} B per row), {index_bytes / 2**20:,.1f} MiB"
        )
        trips = Trips(r)
        policy = str(n // 200)
        step = batches[0][:1]
        episode = np.arange(int(step[0]), int(step[0]) + 40)
        queries: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
            (
                "which data trained policy v",
                lambda: log.trained(policy),
                lambda: scan_trained(log, policy),
            ),
            (
                "which policies trained on step s",
                lambda: log.policies(step),
                lambda: scan_policies(log, step),
            ),
            (
                "... on an episode of 40 steps",
                lambda: log.policies(episode),
                lambda: scan_policies(log, episode),
            ),
        ]
        for what, indexed, scan in queries:
            t_i, got_i, rt_i = best(indexed, args.repeat, trips)
            t_s, got_s, rt_s = best(scan, args.repeat, trips)
            same = (
                [e.entry_id for e in got_i] == got_s if isinstance(got_i, list) else got_i == got_s
            )
            assert same, what
            print(
                f"{what}: index {t_i * 1e3:,.1f} ms ({rt_i} round trips), whole log "
                f"{t_s * 1e3:,.0f} ms ({rt_s} round trips): {t_s / t_i:,.0f}x"
            )


if __name__ == "__main__":
    main()

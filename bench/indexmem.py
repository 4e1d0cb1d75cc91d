"""Sampling index memory per host: a process's own index vs one shared in /dev/shm.

    .venv/bin/python bench/indexmem.py [--steps 10000000] [--shards 4] [--celery]

Fills a private redis-server with N vector steps (obs float32[4], 100-step episodes, a
task id, priorities; ``Store.commit`` in 100k batches), then, for each mode:

- ``own``: two processes (a prefetch pool of 2) each build their own ``SamplingIndex``;
- ``shared``: two processes each sync the host's ``SharedIndex`` (the first builds it,
  the second attaches and reads nothing but the change logs' tails).

Both processes stay alive while the parent measures them (psutil ``memory_full_info``):
RSS counts a shared page in every process that maps it; PSS splits it among them; USS
is what only that process holds. ``index`` is a process's PSS minus its PSS before it
made the index (the imports alone); the host total is the sum of PSS (the shm pages
mapped are in it, split), with the shm files' allocated bytes beside it.

With ``--celery``, the same for a real prefetch worker (``celery worker -Q prefetch -c 2``)
after two recipes' queues were filled at once (one fill per pool process; ``busy`` says
how many held an index). Those figures include each process's samplers (a uniform source
with a filter keeps its candidate rows: int64 per match), which stay per process and per
recipe in both modes: only the columns are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from claw_tasks.worker.command import worker_argv

ROOT = Path(__file__).resolve().parents[1]
EPISODE = 100
MB = 1e6


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
        fields={"obs": rng.standard_normal((n, 4), dtype=np.float32)},
        priority=rng.uniform(0.01, 1.0, n).astype(np.float32),
        strs={"task_id": StrColumn(["grasp", "reach"], (ep % 2).astype(np.int32))},
    )


def mem(pid: int) -> dict[str, float]:
    m = psutil.Process(pid).memory_full_info()
    return {"rss": m.rss / MB, "pss": m.pss / MB, "uss": m.uss / MB}


def child(url: str, namespace: str, mode: str) -> None:
    """Make the index, report, wait for the parent to measure (stdin closes)."""
    from orchestrator.sampling.index import SamplingIndex
    from orchestrator.sampling.shared import SharedIndex

    store = Store(url, namespace)
    store.config(refresh=True)
    before = mem(os.getpid())
    t = time.perf_counter()
    ix = SharedIndex(store) if mode == "shared" else SamplingIndex(store)
    ix.sync()
    took = time.perf_counter() - t
    for col in ix.columns.values():  # touched, as a sampler's filters and trees do
        col.sum()
    ix.release()
    print(json.dumps({"before": before, "seconds": took}), flush=True)
    sys.stdin.read()
    if isinstance(ix, SharedIndex):
        ix.close()


def sampler(url: str, namespace: str, n: int) -> None:
    """``n`` batches of a priority recipe; prints the median and p95 ms per batch."""
    from orchestrator.sampling.sample import sample

    recipe = {
        "name": "p",
        "batch_size": 256,
        "fields": ["obs", "reward"],
        "sources": [
            {"name": "all", "where": {"task_id": "grasp"}, "sampler": {"kind": "priority"}}
        ],
    }
    sample(namespace, recipe, redis_url=url)  # the index and the sampler's trees built
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sample(namespace, recipe, redis_url=url)
        times.append(time.perf_counter() - t)
    print(json.dumps([float(np.median(times)) * 1e3, float(np.percentile(times, 95)) * 1e3]))


def contention(url: str, namespace: str, total: int, batches: int) -> list[str]:
    """Two processes sample while this one commits 256-step batches: every sync has
    something to apply, and with the shared index one process writes while the other
    waits for its lock."""
    store = Store(url, namespace)
    rng = np.random.default_rng(1)
    out = []
    for mode in ("own", "shared", "own", "shared"):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "CLAW_SHARED_INDEX": "1" if mode == "shared" else "0",
        }
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--sampler", url, namespace, str(batches)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        t, committed = time.perf_counter(), 0
        while any(p.poll() is None for p in procs):
            store.commit(steps(total + committed, 256, rng))
            committed += 256
            time.sleep(0.005)
        wall = time.perf_counter() - t
        res = [json.loads(p.communicate()[0]) for p in procs]
        total += committed
        out.append(
            f"| {mode} | "
            + " / ".join(f"{m:.2f} ({q:.2f})" for m, q in res)
            + f" | {wall:.1f} | {committed:,} |"
        )
    return out


def shm_bytes(namespace: str, url: str) -> float:
    from orchestrator.sampling.shared import index_key
    from orchestrator.sampling.shmfiles import SHM_DIR

    key = index_key(Store(url, namespace))
    return sum(p.stat().st_blocks * 512 for p in SHM_DIR.glob(f"clawidx-{key}.*")) / MB


def run_mode(url: str, namespace: str, mode: str) -> dict[str, object]:
    procs, reports = [], []
    for _ in range(2):  # one after the other: the second attaches to what the first built
        p = subprocess.Popen(
            [sys.executable, __file__, "--child", url, namespace, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        reports.append(json.loads(p.stdout.readline()))  # type: ignore[union-attr]
        procs.append(p)
    after = [mem(p.pid) for p in procs]
    shm = shm_bytes(namespace, url)
    for p in procs:
        p.communicate("")
    return {"mode": mode, "reports": reports, "after": after, "shm_mb": shm}


def _holds_index(pid: int, mode: str, index_mb: float) -> bool:
    """Whether a pool process has made its index (own) or mapped the host's (shared)."""
    if mode == "shared":
        return "/clawidx-" in Path(f"/proc/{pid}/maps").read_text()
    return mem(pid)["uss"] > index_mb


def celery_mode(
    url: str, namespace: str, mode: str, log: Path, index_mb: float
) -> dict[str, object]:
    from orchestrator.delivery.client import BatchClient

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CLAW_REDIS_URL": url,
        "CLAW_BROKER_URL": url,
        "CLAW_SHARED_INDEX": "1" if mode == "shared" else "0",
    }
    cmd = worker_argv("prefetch", 2, name=f"b{uuid.uuid4().hex[:6]}", lone=True, heartbeat=False)
    worker = subprocess.Popen(
        cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        while b"ready." not in log.read_bytes():
            time.sleep(0.2)
        client = BatchClient(namespace, url)
        children = psutil.Process(worker.pid).children()
        names = [f"{mode}-a", f"{mode}-b"]
        for name in names:
            client.register(
                {
                    "name": name,
                    "batch_size": 256,
                    "fields": ["obs", "reward"],
                    "sources": [{"name": "all", "where": {"task_id": "grasp"}}],
                    "prefetch": {"depth": 2},
                }
            )
        # Both queues at once: with one fill each, the two pool processes take one each.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda n: BatchClient(namespace, url).pop(n, timeout=900), names))
        for name in names:
            client.pop(name, timeout=900)
        seen = {c.pid for c in children if _holds_index(c.pid, mode, index_mb)}
        after = [mem(c.pid) for c in children]
        shm = shm_bytes(namespace, url)
        client.close()
    finally:
        os.killpg(worker.pid, 15)
        worker.wait()
    return {"mode": f"celery {mode}", "after": after, "shm_mb": shm, "busy": len(seen)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000_000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--celery", action="store_true")
    ap.add_argument("--contention", type=int, default=0, help="batches per sampler")
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--sampler", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.sampler:
        sampler(args.sampler[0], args.sampler[1], int(args.sampler[2]))
        return
    rng = np.random.default_rng(0)
    with RedisServer() as server:
        ns = "indexmem"
        store = Store(server.url, ns)
        store.create(capacity=args.steps, n_shards=args.shards)
        t = time.perf_counter()
        chunk = min(100_000, args.steps // args.shards // 2)  # a shard's part fits its ring
        for start in range(0, args.steps, chunk):
            store.commit(steps(start, min(chunk, args.steps - start), rng))
        print(f"filled {args.steps:,} steps in {time.perf_counter() - t:.0f} s", flush=True)
        if args.contention:
            lines = contention(server.url, ns, args.steps, args.contention)
            print(f"{args.steps:,} steps, {args.shards} shards; load {os.getloadavg()[0]:.1f}")
            print("| index | sample ms per process: median (p95) | wall s | steps committed |")
            print("|---|---|---:|---:|")
            print("\n".join(lines))
            return
        rows = [run_mode(server.url, ns, "own"), run_mode(server.url, ns, "shared")]
        if args.celery:
            log = Path(tempfile.mkdtemp()) / "worker.log"
            index_mb = args.steps * 66 / MB
            rows += [celery_mode(server.url, ns, m, log, index_mb) for m in ("own", "shared")]
    print(
        f"{args.steps:,} steps, {args.shards} shards; {platform.node()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| mode | RSS per process MB | PSS per process MB | USS per process MB "
        "| index per process (PSS) MB | shm MB | host total (sum PSS) MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        after = row["after"]

        def fmt(k: str, after: list = after) -> str:
            return " / ".join(f"{a[k]:.0f}" for a in after)

        reports = row.get("reports")
        index = (
            " / ".join(
                f"{a['pss'] - r['before']['pss']:.0f}" for a, r in zip(after, reports, strict=True)
            )
            if reports
            else "-"
        )
        total = sum(a["pss"] for a in after)
        busy = f" ({row['busy']} of 2 held an index)" if "busy" in row else ""
        print(
            f"| {row['mode']}{busy} | {fmt('rss')} | {fmt('pss')} | {fmt('uss')} | {index} "
            f"| {row['shm_mb']:.0f} | {total:.0f} |"
        )
        if reports:
            made = " / ".join(f"{r['seconds']:.1f}" for r in reports)
            print(f"|   (index made in {made} s) |")


if __name__ == "__main__":
    main()

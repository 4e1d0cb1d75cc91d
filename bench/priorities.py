"""Priority updates of 256 ids at N stored steps: Claw beside cpprb and a numpy sum-tree.

    .venv/bin/python bench/priorities.py [--steps 1000000] [--repeats 300] [--gap-ms 1]

A private redis-server holds N vector steps (``bench/sample_store.py``'s: obs float32[8],
100-step episodes, 95 % of priorities set). Each repeat times, interleaved, the same kind
of update (256 distinct random live ids, uniform priorities):

- Claw, default: ``BatchClient.update_priorities`` (checked and queued; a background
  thread writes behind, in order, later updates winning); the trainer's time only;
- Claw, waiting: ``BatchClient.update_priorities(..., wait=True)`` (the store's update
  script, one round trip, as ``orchestrator.update_priorities``);
- cpprb 11.0.0 ``PrioritizedReplayBuffer.update_priorities`` on a buffer of N (in-process
  C++ sum and min trees), when cpprb is installed (the ``bench`` extra);
- numpy: ``orchestrator.sampling.sumtree.SumTree.update`` of N leaves (the sum-tree the
  samplers keep, alone: the in-process baseline without Redis).

``--gap-ms`` of sleep between repeats stands for the gradient step (the GIL free, as a
torch kernel leaves it). After the loop, the time for the writer to drain (``flush``) and
a check that every submitted priority reached the store. Prints markdown.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sample_store import steps

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator.delivery.client import BatchClient
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.sumtree import SumTree

try:
    from cpprb import PrioritizedReplayBuffer
except ImportError:  # the numpy row is the baseline then
    PrioritizedReplayBuffer = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=1.0)
    a = ap.parse_args()
    n, rng = a.steps, np.random.default_rng(0)
    loads = [os.getloadavg()[0]]
    with RedisServer() as server:
        store = Store(server.url, "bench-prio")
        store.create(capacity=n)
        for start in range(0, n, 100_000):
            store.commit(steps(start, min(100_000, n - start), rng))
        index = SamplingIndex(store)
        index.sync()
        live = rng.permutation(index.columns["id"][index.columns["alive"]])
        waited, behind = live[: len(live) // 2], live[len(live) // 2 :]  # disjoint
        client = BatchClient("bench-prio", server.url)
        tree = SumTree(rng.uniform(0.01, 1.0, n))
        cpp = None
        if PrioritizedReplayBuffer is not None:
            cpp = PrioritizedReplayBuffer(n, {"obs": {"shape": 8}, "act": {"shape": 1}})
            cpp.add(obs=np.zeros((n, 8), np.float32), act=np.zeros((n, 1)))
        times: dict[str, list[float]] = {"default": [], "wait": [], "cpprb": [], "numpy": []}
        last: dict[int, float] = {}
        for _ in range(a.repeats):
            ids = rng.choice(waited, 256, replace=False)
            pr = rng.uniform(0.01, 1.0, 256).astype(np.float32)
            idx = np.sort(rng.choice(n, 256, replace=False))
            t = time.perf_counter()
            client.update_priorities(ids, pr, wait=True)
            times["wait"].append(time.perf_counter() - t)
            time.sleep(a.gap_ms / 1e3)
            ids = rng.choice(behind, 256, replace=False)
            t = time.perf_counter()
            client.update_priorities(ids, pr)
            times["default"].append(time.perf_counter() - t)
            last.update(zip(ids.tolist(), pr.tolist(), strict=True))
            time.sleep(a.gap_ms / 1e3)
            if cpp is not None:
                t = time.perf_counter()
                cpp.update_priorities(idx, pr)
                times["cpprb"].append(time.perf_counter() - t)
            t = time.perf_counter()
            tree.update(idx.copy(), pr.astype(np.float64))
            times["numpy"].append(time.perf_counter() - t)
            time.sleep(a.gap_ms / 1e3)
        t = time.perf_counter()
        client.flush_priorities()
        drain = time.perf_counter() - t
        index.sync()  # the store's priorities, as a sampler sees them
        pos = {int(i): k for k, i in enumerate(index.columns["id"])}
        stored = index.columns["priority"]
        wrong = sum(abs(stored[pos[i]] - p) > 1e-6 for i, p in last.items())
        client.close()
        loads.append(os.getloadavg()[0])
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; load average "
        f"{loads[0]:.1f} -> {loads[1]:.1f}; {n:,} steps, 256 ids per update, "
        f"{a.repeats} repeats interleaved, {a.gap_ms:g} ms between calls\n"
    )
    print("| update_priorities(256) | median ms | p95 ms | / cpprb |")
    print("|---|---:|---:|---:|")
    ref = float(np.median(times["cpprb"])) if times["cpprb"] else None
    labels = {
        "default": "Claw, `update_priorities` (written behind; trainer's time)",
        "wait": "Claw, `update_priorities(..., wait=True)` (waits for the store)",
        "cpprb": "cpprb 11.0.0 `PrioritizedReplayBuffer` (in-process)",
        "numpy": "numpy `SumTree.update` (in-process)",
    }
    for key, label in labels.items():
        if not times[key]:
            continue
        med, p95 = np.median(times[key]) * 1e3, np.percentile(times[key], 95) * 1e3
        ratio = f"{med / (ref * 1e3):.1f}x" if ref else "-"
        print(f"| {label} | {med:.4f} | {p95:.4f} | {ratio} |")
    print(
        f"\nwriter drained in {drain * 1e3:.2f} ms after the last submit; "
        f"{len(last)} submitted ids checked in the store, {wrong} with another priority"
    )


if __name__ == "__main__":
    main()

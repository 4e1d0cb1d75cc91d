"""Time to draw the indices and IS weights of a 256 batch (filter + priority) at 10k-10M rows.

Synthetic metadata columns of one namespace; the recipe filters on three columns (about 5%
of the rows match) and samples by priority (5% of priorities unset). Columns:

- build: the first draw (mask, sum trees, max-priority tree), once per params change
- draw: a draw on a current index (median)
- refresh(256): account for 256 updated priorities (median)
- update+draw: refresh(256) then draw, the steady state of a training loop (median)
- scan: the same draw without an index (mask, masked cumsum, searchsorted) for comparison

Run: ``.venv/bin/python bench/sample_index.py [--sizes 10000 100000 1000000 10000000]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from claw_tasks.where import Where
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.candidates import eligible
from orchestrator.sampling.samplers import RecipeSampler

CODES = {"grasp": 1, "reach": 2, "lift": 3, "push": 4, "place": 5}
WHERE = {"task_id": "grasp", "skill_tag": {"in": ["reach", "grasp"]}, "reward": {"gt": 0.0}}
RECIPE = Recipe.model_validate(
    {
        "name": "bench",
        "batch_size": 256,
        "fields": ["obs", "action", "reward"],
        "sources": [{"name": "hard", "where": WHERE, "sampler": {"kind": "priority"}}],
    }
)


def encode(column: str, strings: list[str]) -> np.ndarray:
    return np.array([CODES.get(s, -1) for s in strings])


def synthetic(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    priority = rng.random(n, dtype=np.float32) + np.float32(0.01)
    priority[rng.random(n) < 0.05] = np.nan
    zeros = np.zeros(n, np.int32)
    return {
        "alive": np.ones(n, bool),
        "id": np.arange(1, n + 1, dtype=np.int64),
        "episode": np.arange(n, dtype=np.int64) // 200 + 1,
        "step_index": (np.arange(n) % 200).astype(np.int32),
        "agent_id": zeros,
        "task_id": rng.integers(1, 5, n, dtype=np.int32),
        "skill_tag": rng.integers(1, 6, n, dtype=np.int32),
        "reward_source": zeros,
        "quality": zeros,
        "policy_version": zeros,
        "timestamp": np.arange(n, dtype=np.float64),
        "reward": rng.uniform(-1, 1, n).astype(np.float32),
        "priority": priority,
        "next": np.ones(n, np.int32),
        "flags": np.zeros(n, np.uint8),
    }


def scan_draw(cols: dict[str, np.ndarray], where: Where, rng: np.random.Generator) -> None:
    """The index-free baseline: mask, masked cumsum, searchsorted, weights."""
    rows = np.flatnonzero(eligible(cols) & where.mask(cols, {}))
    p = cols["priority"][rows].astype(np.float64)
    mass = np.where(np.isnan(p), np.nanmax(cols["priority"]), p) ** 0.6
    cs = np.cumsum(mass)
    pick = np.searchsorted(cs, rng.random(256) * cs[-1], side="right")
    w = (len(rows) * mass[pick] / cs[-1]) ** -0.4
    w /= w.max()


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def bench(n: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    cols = synthetic(n, rng)
    sampler = RecipeSampler(RECIPE, encode, {}, cap=n)
    t = time.perf_counter()
    sampler.sample(cols, rng)
    build = (time.perf_counter() - t) * 1e3
    draw = median_ms(lambda: sampler.sample(cols, rng), repeats)

    def update() -> None:
        rows = rng.integers(0, n, 256)
        cols["priority"][rows] = rng.random(256, dtype=np.float32) + np.float32(0.01)
        sampler.refresh(cols, rows)

    refresh = median_ms(update, repeats)
    both = median_ms(lambda: (update(), sampler.sample(cols, rng)), repeats)
    where = Where(WHERE, {}, encode)
    scan = median_ms(lambda: scan_draw(cols, where, rng), max(3, repeats // 20))
    return {
        "candidates": sampler.sources[0].n,
        "build": build,
        "draw": draw,
        "refresh": refresh,
        "both": both,
        "scan": scan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**4, 10**5, 10**6, 10**7])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"numpy {np.__version__}\n"
    )
    print("| rows | candidates | build ms | draw ms | refresh(256) ms | update+draw ms | scan ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        r = bench(n, args.repeats)
        print(
            f"| {n:,} | {r['candidates']:,} | {r['build']:.1f} | {r['draw']:.3f} | "
            f"{r['refresh']:.3f} | {r['both']:.3f} | {r['scan']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Prefetch throughput: augmented images per second of one worker process.

    .venv/bin/python bench/prefetch.py [--steps 20000] [--batches 60] [--stages]

Fills a private redis-server with uint8 84x84x3 image steps (Store.commit, no Celery),
registers a DrQ recipe (batch 256, obs and next_obs, random shift pad 4) and runs the
prefetch fill loop in this process (what a prefetch worker's task does): sample, fetch
payloads, augment, collate, encode, push. A trainer in another process (as in a real run)
takes every batch the way ``BatchClient.pop`` does and holds it until the next one, so
what the trainer's side costs (mapping, unmapping) is not counted as the worker's. Counts
obs and next_obs images. A second row times the same loop without augmentation, to show
what the shift itself costs. ``--stages`` adds where the worker's CPU time goes per batch
(``process_time`` around each stage of the augmented loop).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import cv2
import numpy as np

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from orchestrator.delivery import prefetch, shm
from orchestrator.delivery.prefetch import run_fill
from orchestrator.delivery.registry import Registry
from orchestrator.delivery.wire import WireBatch
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.fetch import LogChecked
from orchestrator.transforms.augment import AugmentPlan


def fill_store(store: Store, n: int) -> None:
    rng = np.random.default_rng(0)
    ep_len = 500
    for start in range(0, n, 1000):
        k = min(1000, n - start)
        idx = np.arange(start, start + k)
        store.commit(
            StepBatch(
                episode=StrColumn.of([f"e{i // ep_len}" for i in idx]),
                step_index=idx % ep_len,
                reward=np.ones(k, np.float32),
                terminated=(idx % ep_len) == ep_len - 1,
                truncated=np.zeros(k, bool),
                fields={
                    "obs": rng.integers(0, 256, (k, 84, 84, 3), dtype=np.uint8),
                    "action": np.zeros(k, np.int64),
                },
                next_rows=np.flatnonzero((idx % ep_len) == ep_len - 1).astype(np.int32),
                next_obs=np.zeros((int(((idx % ep_len) == ep_len - 1).sum()), 84, 84, 3), np.uint8),
            )
        )


def trainer(items: mp.connection.Connection, ready: Any) -> None:
    """Decode each queue item as ``BatchClient.pop`` does; hold it until the next one.
    ``ready`` (an Event) is set once it reads: until then no segment is released, and a
    loaded machine spawns a process slower than a short run lasts."""
    ready.set()
    held = None
    while item := items.recv_bytes():
        held = shm.from_message(item)
    del held


def run(
    reg: Registry, recipe: Recipe, batches: int, to_trainer: mp.connection.Connection
) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds for ``batches`` batches."""
    reg.put(recipe, shm.host_id())  # a trainer on this host: batches go through /dev/shm
    made, t0, c0 = 0, time.perf_counter(), time.process_time()
    while made < batches:
        made += run_fill(reg, recipe.name)["made"]
        for item in reg.drain(recipe.name):  # the trainer takes everything
            to_trainer.send_bytes(item)
    return time.perf_counter() - t0, time.process_time() - c0


def timed(cpu: Counter, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` adding its CPU time to ``cpu[label]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu[label] += time.process_time() - c0

    return wrapper


def stages(reg: Registry, recipe: Recipe, batches: int, to_trainer: Any) -> Counter:
    """CPU seconds per stage of ``batches`` batches (wrappers installed for this run only)."""
    # Where the fill's stages call them. This file also times older trees, which have no
    # stages module (the fill called them in prefetch itself) and lack some of the names
    # below: run as ``PYTHONPATH=<that tree> python bench/prefetch.py --stages``, the way
    # docs/benchmarks.md compares with an earlier commit's figures (bench/versus.py runs
    # each tree's own copy instead).
    try:
        made = importlib.import_module("orchestrator.delivery.stages")
    except ModuleNotFoundError:
        made = prefetch
    patches = [
        (made, "sample_clean", "sample (sync, draw, fetch)"),
        (LogChecked, "__call__", "of which payload fetch"),
        (AugmentPlan, "apply", "augment"),
        (made, "to_wire", "lay out for the wire"),
        (shm, "write_segment", "write into the segment"),
        (WireBatch, "write_into", "write the rest into a reused segment's mapping"),
        (prefetch, "push", "push"),
    ]
    patches = [p for p in patches if hasattr(*p[:2])]  # an older tree's (above)
    cpu: Counter = Counter({label: 0.0 for *_, label in patches})
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, label in patches:
        setattr(obj, name, timed(cpu, label, getattr(obj, name)))
    try:
        cpu["whole loop"] = run(reg, recipe, batches, to_trainer)[1]
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--stages", action="store_true", help="also time each stage")
    args = ap.parse_args()
    cv2.setNumThreads(1)
    base = {
        "batch_size": 256,
        "fields": ["obs", "next_obs", "action", "reward"],
        "sources": [{"name": "all"}],
        "prefetch": {"depth": 8},
        "seed": 1,
    }
    ctx = mp.get_context("spawn")
    got, send = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    reader = ctx.Process(target=trainer, args=(got, ready), daemon=True)
    reader.start()
    ready.wait()
    with RedisServer() as srv:
        store = Store(srv.client(), "bench")
        store.create(capacity=args.steps)
        fill_store(store, args.steps)
        reg = Registry(store)
        drq = Recipe.model_validate(
            {
                **base,
                "name": "drq",
                "augment": {"obs": [{"random_shift": {"pad": 4}}], "next_obs": "same"},
            }
        )
        plain = Recipe.model_validate({**base, "name": "plain"})
        run(reg, drq, 4, send)  # warm up: index, caches
        run(reg, plain, 4, send)
        t_aug = run(reg, drq, args.batches, send)
        t_plain = run(reg, plain, args.batches, send)
        cpu = stages(reg, drq, args.batches, send) if args.stages else Counter()
        send.send_bytes(b"")
        reader.join()
    images = args.batches * 256 * 2
    size = f"{args.batches} batches of 256, {args.steps:,} stored steps"
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, one prefetch process, "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| figure | value | size |\n|---|---:|---|")
    rows = [
        (
            "augmented images/s per worker core (CPU time, shift, obs + next_obs)",
            f"{images / t_aug[1]:,.0f}",
            size,
        ),
        (
            "augmented images/s, wall clock (Redis on the other core)",
            f"{images / t_aug[0]:,.0f}",
            "same",
        ),
        ("without augmentation: images/s per worker core", f"{images / t_plain[1]:,.0f}", "same"),
        (
            "time per 256-step batch with shift, wall",
            f"{t_aug[0] / args.batches * 1e3:.1f} ms",
            "same",
        ),
    ]
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if cpu:
        print("\n| stage (augmented loop) | worker CPU ms per batch |\n|---|---:|")
        for label, seconds in cpu.items():
            print(f"| {label} | {seconds / args.batches * 1e3:.2f} |")


if __name__ == "__main__":
    main()

"""Trainer-side time per batch: Claw ``pop`` versus the in-loop baseline, and pop latency.

    .venv/bin/python bench/trainer.py [--steps 10000] [--batches 60] [--pops 2000]

Starts a private redis-server and one real Celery worker on the ``ingest`` and ``prefetch``
queues (prefork, ``--concurrency`` processes), ingests image steps (uint8 84x84x3) and
vector steps (float32[8]), and measures in one run:

- images, 256 steps with obs and next_obs and a random shift (pad 4): the baseline samples
  an in-process numpy replay buffer and runs albumentations 2.0.8 on every image in the
  loop; Claw pops a batch the prefetch workers sampled, shifted and queued. Between pops
  the trainer "trains" for ``--train-ms`` (a sleep, as a GPU step would leave the CPU free);
  only pops that find a batch queued are timed (the figure is the pop, not a wait for
  production, which is counted and printed);
- pop latency p50/p99 of a 256 x float32[8] batch: alone (a queue prefetched deeper than
  the pops, so no refill runs meanwhile) and while the worker refills (``--vector-train-ms``
  between pops; on a small machine the worker and Redis then compete with the trainer);
  then the same refilling loop with a read-ahead client (``BatchClient(readahead=8)``:
  a thread keeps 8 batches popped and decoded in the trainer's process), where a pop is
  timed when one is held locally;
- trainer CPU per popped batch: the thread CPU time of ``ClawReplayBuffer.sample(256)``
  (SB3's adapter, one popped batch a call: its read-ahead process's item read from the
  pipe, decoded, made SB3's tensors, its lineage entry declared), median of
  ``--cpu-pops`` calls with ``--vector-train-ms`` between them, steps of obs float32[8],
  a discrete action, reward, next_obs and the done flags. Wrapped (the adapter's
  default): the layout parsed once and kept, the flags delivered as float32 (the recipe's
  ``layout``), each tensor a view of the delivered bytes. Beside it in the same run,
  alternated ``--cpu-rounds`` times, the conversion field by field: the layout parsed per
  batch, the flags cast in the trainer, each array copied into its tensor. Then each
  side's per-batch work alone, in memory: one queue item copied (as out of the pipe),
  decoded and converted, back to back.

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import albumentations as A
import cv2
import numpy as np
import redis
import torch as th
from gymnasium import spaces

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from orchestrator.adapters.sb3.buffer import ClawReplayBuffer
from orchestrator.delivery import wire
from orchestrator.delivery.client import BatchClient
from orchestrator.sampling.batch import Batch
from tests.support.processes import Worker

B, H, W, PAD = 256, 84, 84, 4
PAGE = 4096


def ingest(url: str, ns: str, obs: np.ndarray, episode_len: int) -> None:
    """Episodes of ``episode_len`` steps; the last step of each terminates."""
    n = len(obs)
    step = np.arange(n) % episode_len
    ing = Ingestor(ns, url, flush_interval=None, flush_steps=512, capacity=n + 1)
    ing.add_batch(
        {
            "obs": obs,
            "action": np.zeros(n, np.int64),
            "reward": np.ones(n, np.float32),
            "episode_id": (np.arange(n) // episode_len).astype(str),
            "step_index": step,
            "terminated": step == episode_len - 1,
        }
    )
    assert ing.close(timeout=600).committed == n


def baseline_batch(
    obs: np.ndarray, next_obs: np.ndarray, shift: A.Compose, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """The in-loop baseline: sample 256 rows, shift every obs and next_obs image."""
    idx = rng.integers(0, len(obs), B)
    return {
        k: np.stack([shift(image=im)["image"] for im in v[idx]])
        for k, v in (("obs", obs), ("next_obs", next_obs))
    }


def touch(batch: Batch) -> int:
    """Read one byte per page of every field (what a first use of the arrays costs)."""
    return sum(int(v.reshape(-1).view(np.uint8)[::PAGE].sum()) for v in batch.values())


def paced_pops(
    client: BatchClient,
    r: redis.Redis,
    name: str,
    n: int,
    train_s: float,
    use: Callable[[Batch], Any] | None = None,
) -> tuple[list[float], int]:
    """Time ``n`` pops (plus ``use`` of the batch), each after a simulated train step;
    a pop that finds the queue empty waits for a batch and is not timed. Returns the times
    and how many pops waited."""
    queue, times, waited = client.registry.queue(name), [], 0
    while len(times) < n:
        time.sleep(train_s)
        ready = client.held(name) > 0 if client.readahead else bool(r.llen(queue))
        t0 = time.perf_counter()
        batch = client.pop(name, timeout=60)
        if use is not None:
            use(batch)
        if ready:
            times.append(time.perf_counter() - t0)
        else:
            waited += 1
    return times, waited


def wait_full(client: BatchClient, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (s := client.stats(name)[name])["depth"] < s["max_depth"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"queue of {name} not full: {s}")
        time.sleep(0.05)


class FieldByFieldBuffer(ClawReplayBuffer):
    """SB3's adapter converting field by field: every array copied into its tensor (its
    recipe, given ``layout: None``, leaves the done flags bool: cast in the trainer)."""

    def tensor(self, array: np.ndarray) -> th.Tensor:
        return th.tensor(array, device=self.device)


def trainer_cpu(url: str, pops: int, rounds: int, train_s: float) -> dict[str, list[float]]:
    """Thread CPU seconds of each ``sample(256)`` (one popped batch a call), wrapped and
    field by field, alternated ``rounds`` times in this run."""
    obs_space, n = spaces.Box(-10, 10, (8,), np.float32), 20_000
    kw: dict[str, Any] = {"device": "cpu", "namespace": "sb3", "redis_url": url}
    wrapped = ClawReplayBuffer(100_000, obs_space, spaces.Discrete(2), gradient_steps=1, **kw)
    obs = np.random.default_rng(1).standard_normal((n + 1, 8)).astype(np.float32)
    for i in range(n):
        done = np.array([i % 500 == 499])
        wrapped.add(obs[i : i + 1], obs[i + 1 : i + 2], np.array([i % 2]), np.ones(1), done, [{}])
    wrapped.flush()
    by_field = FieldByFieldBuffer(
        100_000, obs_space, spaces.Discrete(2), gradient_steps=1, recipe={"layout": None}, **kw
    )
    times: dict[str, list[float]] = {
        k: [] for k in ("by field", "wrapped", "by field, in memory", "wrapped, in memory")
    }
    try:
        for _ in range(rounds):
            for label, buffer, kept in (
                ("by field", by_field, 0),  # 0: every layout parsed again
                ("wrapped", wrapped, wire.LAYOUTS_KEPT),
            ):
                wire.LAYOUTS.kept = kept
                for _ in range(20):  # the read-ahead process started, its queue filled
                    buffer.sample(256)
                for _ in range(pops):
                    time.sleep(train_s)
                    t0 = time.thread_time()
                    buffer.sample(256)
                    times[label].append(time.thread_time() - t0)
                times[f"{label}, in memory"] += in_memory(buffer, pops)
    finally:
        wire.LAYOUTS.kept = wire.LAYOUTS_KEPT
        by_field.close()
        wrapped.close()
    return times


def in_memory(buffer: ClawReplayBuffer, n: int) -> list[float]:
    """Thread CPU seconds of the per-batch work alone, back to back on one queue item held
    in memory: the copy out of the pipe, the decode and the adapter's conversion (no pipe,
    no Redis, no lineage)."""
    client, name = buffer.client, buffer.recipe_name(256)
    item, times = client.next_item(name, timeout=60), []
    for _ in range(n):
        t0 = time.thread_time()
        batch = client.accept(name, memoryview(bytearray(item)))
        assert batch is not None
        buffer.to_samples(batch)
        times.append(time.thread_time() - t0)
    return times


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000, help="image steps stored")
    ap.add_argument("--batches", type=int, default=60, help="image batches per side")
    ap.add_argument("--pops", type=int, default=2000, help="vector pops")
    ap.add_argument("--train-ms", type=float, default=60.0, help="simulated step, images")
    ap.add_argument("--vector-train-ms", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--cpu-pops", type=int, default=1000, help="samples per side and round")
    ap.add_argument("--cpu-rounds", type=int, default=2)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the worker on the way out
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (args.steps, H, W, 3), dtype=np.uint8)
    vectors = rng.standard_normal((100_000, 8)).astype(np.float32)
    shift = A.Compose(
        [
            A.PadIfNeeded(H + 2 * PAD, W + 2 * PAD, border_mode=cv2.BORDER_REPLICATE),
            A.RandomCrop(H, W),
        ]
    )
    cv2.setNumThreads(1)  # slightly faster than the default for per-image ops here
    with RedisServer() as srv:
        r = srv.client()
        worker = Worker(
            srv.url, "ingest,prefetch", args.concurrency, Path("/tmp/claw-bench-trainer.log"), {}
        )
        try:
            ingest(srv.url, "img", frames, episode_len=500)
            ingest(srv.url, "vec", vectors, episode_len=1000)
            img = BatchClient("img", srv.url)
            img.register(
                {
                    "name": "drq",
                    "batch_size": B,
                    "fields": ["obs", "action", "reward", "next_obs", "terminated"],
                    "sources": [{"name": "all"}],
                    "augment": {"obs": [{"random_shift": {"pad": PAD}}], "next_obs": "same"},
                    "prefetch": {"depth": 8},
                }
            )
            vec = BatchClient("vec", srv.url)
            for name, depth, low in (("v8", 16, 8), ("v8-alone", args.pops + 50, 10)):
                vec.register(
                    {
                        "name": name,
                        "batch_size": B,
                        "fields": ["obs"],
                        "sources": [{"name": "all"}],
                        "prefetch": {"depth": depth, "low_water": low},
                    }
                )
                wait_full(vec, name)
            wait_full(img, "drq")

            time.sleep(1.0)  # let the last fills finish
            alone, _ = paced_pops(vec, r, "v8-alone", args.pops, 0.0)  # nothing else runs
            # Baseline buffer: obs and next_obs arrays, as an SB3-style buffer keeps them.
            nxt = np.roll(frames, -1, axis=0)
            base = []
            for _ in range(args.batches):
                t0 = time.perf_counter()
                baseline_batch(frames, nxt, shift, rng)
                base.append(time.perf_counter() - t0)
            train_s = args.train_ms / 1e3
            pop_img, waited_img = paced_pops(img, r, "drq", args.batches, train_s)
            used_img, waited_used = paced_pops(img, r, "drq", args.batches, train_s, touch)
            pop_vec, waited_vec = paced_pops(vec, r, "v8", args.pops, args.vector_train_ms / 1e3)
            ahead = BatchClient("vec", srv.url, readahead=8)
            pop_ahead, waited_ahead = paced_pops(
                ahead, r, "v8", args.pops, args.vector_train_ms / 1e3
            )
            ahead.close()
            cpu = trainer_cpu(srv.url, args.cpu_pops, args.cpu_rounds, args.vector_train_ms / 1e3)
            produced = img.stats("drq")["drq"]["produced"]
            img.unregister("drq")  # reclaims the queued shared-memory segments
            img.close()
            vec.close()
        finally:
            worker.stop()

    b, c, u = (statistics.median(x) for x in (base, pop_img, used_img))
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; worker concurrency {args.concurrency}\n"
    )
    print("| figure | value | size | target |\n|---|---:|---|---:|")
    size = f"256 steps, obs+next_obs uint8 84x84x3, median of {args.batches}"
    rows = [
        ("baseline: numpy buffer sample + albumentations shift in the loop", ms(b), size, ""),
        ("Claw: `pop` (prefetched, shifted, shared memory)", ms(c), size, ""),
        ("Claw / baseline", f"1/{b / c:,.0f}", "same run", "<= 1/10"),
        ("Claw: `pop` + first touch of every page", ms(u), size, ""),
        ("Claw (with first touch) / baseline", f"1/{b / u:,.0f}", "same run", "<= 1/10"),
    ]
    refilling = f"worker refilling, {args.vector_train_ms:g} ms between pops"
    ahead_label = f"read-ahead client (readahead=8), {refilling}"
    for label, times in (("alone", alone), (refilling, pop_vec), (ahead_label, pop_ahead)):
        p50, p99 = np.percentile(times, [50, 99])
        size = f"256 x float32[8], {len(times)} pops"
        rows.append((f"pop latency p50, {label}", ms(p50), size, "<= 0.5 ms"))
        rows.append((f"pop latency p99, {label}", ms(p99), size, ""))
    size = f"256 x (obs float32[8], action, reward, next_obs, flags), {len(cpu['wrapped'])} pops"
    for where in ("", ", in memory"):
        by_field, wrapped = (statistics.median(cpu[k + where]) for k in ("by field", "wrapped"))
        rows += [
            (f"trainer CPU per popped batch{where}, field by field", us(by_field), size, ""),
            (f"trainer CPU per popped batch{where}, wrapped", us(wrapped), size, "<= 50 us"),
            (f"wrapped / field by field{where}", f"{wrapped / by_field:.2f}x", "same run", ""),
        ]
    for row in rows:
        print("| " + " | ".join(row) + " |")
    waits = (
        f"{waited_img + waited_used}/{2 * args.batches} image, {waited_vec}/{args.pops} vector, "
        f"{waited_ahead}/{args.pops} read-ahead vector"
    )
    print(
        f"\npops that found the queue empty (waited, untimed): {waits}; "
        f"image batches produced: {produced}"
    )


if __name__ == "__main__":
    main()

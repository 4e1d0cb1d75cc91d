"""Sampling from a real Redis store: whole batches, the draw, index sync, priority updates.

A private redis-server holds N vector steps (obs float32[8], action int64, 100-step
episodes, 4 task ids, 95% of priorities set), filled with big ``Store.commit`` batches.
The recipe filters (``task_id in [grasp, reach]`` and ``reward > 0``: ~25% of the steps)
and samples 256 rows by priority. Columns (medians over ``--repeats``, p95 in brackets):

- cold: build the index from Redis (``SamplingIndex.sync`` on a new index); index MB: its
  numpy columns (obs and action mirrored: ``CLAW_INDEX_PAYLOAD_BYTES``)
- batch: ``orchestrator.sample`` with fields obs, action, reward, next_obs on a quiet store
  (nothing committed since the last batch): draw from the index as it is, then one round
  trip that reads each shard's change log from the index's last entry; with its CPU per batch, this
  process's and redis-server's (``INFO cpu``), which the machine's load skews less
- unmirrored: the same batch from an index that mirrors no payload field
  (``payload_bytes=0``): the rows read by ``fetch.lua``
- after commit: a 256-step commit before each batch (a changing store): index sync (log
  page with the re-read of the committed slots), draw, fetch with the change log read after it
  (``bench/changing_batch.py`` counts the round trips and profiles it)
- draw: the draw alone on a current index (rows and IS weights)
- sync(256): commit 256 new steps, then time the index sync plus sampler refresh
- update(256): ``update_priorities`` of 256 random live ids through the store

Peers in the same run, per size: cpprb's in-process ``PrioritizedReplayBuffer.sample(256)``
(alpha 0.6, beta 0.4; the same four fields; when cpprb, the ``bench`` extra, is installed)
and one Redis round trip (``PING``) on the same server: a batch from Redis cannot beat
the round trip, and the in-process buffer is what it replaces.

Then, with ``--images N`` (default 20,000): a uniform batch of 256 image transitions
(obs and next_obs uint8 84x84x3: 10.8 MB) with big rows read by plain pipelined commands
(the default) and, for comparison, inside the fetch script.

Run: ``.venv/bin/python bench/sample_store.py [--sizes 10000 100000 1000000] [--images N]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store, slots
from orchestrator import Recipe, sample, update_priorities
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.samplers import RecipeSampler
from orchestrator.sampling.strings import Strings

TASKS = ["grasp", "reach", "lift", "push"]
EPISODE = 100
RECIPE = Recipe.model_validate(
    {
        "name": "bench",
        "batch_size": 256,
        "fields": ["obs", "action", "reward", "next_obs"],
        "sources": [
            {
                "name": "hard",
                "where": {"task_id": {"in": ["grasp", "reach"]}, "reward": {"gt": 0}},
                "sampler": {"kind": "priority", "alpha": 0.6, "beta": 0.4},
            }
        ],
    }
)


def steps(start: int, n: int, rng: np.random.Generator) -> StepBatch:
    """Steps ``start .. start+n`` of consecutive 100-step episodes."""
    i = np.arange(start, start + n)
    ep, t = i // EPISODE, i % EPISODE
    first = int(ep[0])
    priority = rng.uniform(0.01, 1.0, n).astype(np.float32)
    priority[rng.random(n) < 0.05] = np.nan
    return StepBatch(
        episode=StrColumn([f"ep{e}" for e in range(first, int(ep[-1]) + 1)], ep - first),
        step_index=t,
        reward=rng.uniform(-1, 1, n).astype(np.float32),
        terminated=t == EPISODE - 1,
        truncated=np.zeros(n, bool),
        fields={
            "obs": rng.standard_normal((n, 8), dtype=np.float32),
            "action": rng.integers(0, 4, n),
        },
        priority=priority,
        strs={"task_id": StrColumn(TASKS, (ep % 4).astype(np.int32))},
    )


def image_steps(start: int, n: int, rng: np.random.Generator) -> StepBatch:
    b = steps(start, n, rng)
    b.fields["obs"] = rng.integers(0, 256, (n, 84, 84, 3), dtype=np.uint8)
    b.strs.clear()
    return b


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median and p95 in milliseconds."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3, float(np.percentile(times, 95)) * 1e3


def cpu_ms(store: Store, fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """CPU milliseconds per call of this process and of redis-server."""

    def server() -> float:
        info = store.r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    s0, c0 = server(), time.process_time()
    for _ in range(repeats):
        fn()
    c1, s1 = time.process_time(), server()
    return (c1 - c0) / repeats * 1e3, (s1 - s0) / repeats * 1e3


def bench(url: str, n: int, repeats: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    store = Store(url, f"bench-{n}")
    store.create(capacity=n)
    chunk = min(n, 100_000)
    for start in range(0, n, chunk):
        store.commit(steps(start, chunk, rng))
    index = SamplingIndex(store)
    t = time.perf_counter()
    index.sync()
    cold = (time.perf_counter() - t) * 1e3
    index_mb = sum(c.nbytes for c in index.columns.values()) / 1e6

    sample(store, RECIPE, rng=rng, index=index)  # binds the recipe: sampler trees built
    batch = timed(lambda: sample(store, RECIPE, rng=rng, index=index), repeats)
    batch_cpu = cpu_ms(store, lambda: sample(store, RECIPE, rng=rng, index=index), repeats)
    plain = SamplingIndex(store, payload_bytes=0)
    sample(store, RECIPE, rng=rng, index=plain)
    unmirrored = timed(lambda: sample(store, RECIPE, rng=rng, index=plain), repeats)
    sampler = RecipeSampler(RECIPE, Strings(store, index).encode, index.schema.tags, index.cap)
    sampler.sample(index.columns, rng)
    draw = timed(lambda: sampler.sample(index.columns, rng), repeats)

    sync = []  # the index's sync notifies the recipe's sampler: its refresh is included
    for i in range(repeats):
        store.commit(steps(n + 256 * i, 256, rng))
        t = time.perf_counter()
        index.sync()
        sync.append(time.perf_counter() - t)
    changing = []
    for i in range(repeats):
        store.commit(steps(n + 256 * (repeats + i), 256, rng))
        t = time.perf_counter()
        sample(store, RECIPE, rng=rng, index=index)
        changing.append(time.perf_counter() - t)
    live = index.columns["id"][index.columns["alive"]]

    def update() -> None:
        ids = rng.choice(live, 256, replace=False)
        update_priorities(store, ids, rng.uniform(0.01, 1.0, 256))

    upd = timed(update, repeats)
    cand = sampler.sources[0].n
    store.r.flushdb()
    return {
        "candidates": cand,
        "cold": cold,
        "index_mb": index_mb,
        "batch": batch,
        "batch_cpu": batch_cpu,
        "unmirrored": unmirrored,
        "changing": (float(np.median(changing)) * 1e3, float(np.percentile(changing, 95)) * 1e3),
        "draw": draw,
        "sync": (float(np.median(sync)) * 1e3, float(np.percentile(sync, 95)) * 1e3),
        "update": upd,
    }


def bench_images(url: str, n: int, repeats: int) -> dict[str, tuple[float, float]]:
    rng = np.random.default_rng(1)
    store = Store(url, f"images-{n}")
    store.create(capacity=n)
    for start in range(0, n, 2000):
        store.commit(image_steps(start, min(2000, n - start), rng))
    recipe = Recipe.model_validate(
        {
            "name": "img",
            "batch_size": 256,
            "fields": ["obs", "next_obs"],
            "sources": [{"name": "u"}],
        }
    )
    out, default = {}, slots.PLAIN_ROW_BYTES
    for label, plain_from in (("plain", default), ("lua", 1 << 40)):
        slots.PLAIN_ROW_BYTES = plain_from
        index = SamplingIndex(store)
        sample(store, recipe, rng=rng, index=index)
        out[label] = timed(lambda i=index: sample(store, recipe, rng=rng, index=i), repeats)
    slots.PLAIN_ROW_BYTES = default
    store.r.flushdb()
    return out


def peers(url: str, n: int, repeats: int) -> dict[str, tuple[float, float] | None]:
    """The in-process buffer a batch replaces (cpprb, if installed) and one round trip."""
    import redis

    r = redis.Redis.from_url(url)
    out: dict[str, tuple[float, float] | None] = {"ping": timed(r.ping, repeats), "cpprb": None}
    try:
        from cpprb import PrioritizedReplayBuffer
    except ImportError:
        return out
    rng = np.random.default_rng(2)
    env = {
        "obs": {"shape": 8},
        "action": {"dtype": np.int64},
        "reward": {},
        "next_obs": {"shape": 8},
    }
    rb = PrioritizedReplayBuffer(n, env, alpha=0.6)
    for start in range(0, n, 100_000):
        k = min(100_000, n - start)
        obs = rng.normal(size=(k, 8)).astype(np.float32)
        rb.add(obs=obs, action=np.zeros(k, np.int64), reward=rng.random(k), next_obs=obs)
    rb.sample(256, beta=0.4)
    out["cpprb"] = timed(lambda: rb.sample(256, beta=0.4), repeats)
    return out


def fmt(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.2f} ({pair[1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**4, 10**5, 10**6])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--images", type=int, default=20_000, help="image steps (0: skip)")
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"numpy {np.__version__}"
    )
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(
        "| steps | candidates | index MB | cold ms | batch ms | batch CPU ms (this / Redis) "
        "| unmirrored ms | after commit ms | draw ms | sync(256) ms | update(256) ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with RedisServer() as server:
        for n in args.sizes:
            r = bench(server.url, n, args.repeats)
            print(
                f"| {n:,} | {r['candidates']:,} | {r['index_mb']:.1f} | {r['cold']:.0f} | "
                f"{fmt(r['batch'])} | {r['batch_cpu'][0]:.2f} / {r['batch_cpu'][1]:.3f} | "
                f"{fmt(r['unmirrored'])} | {fmt(r['changing'])} | "
                f"{fmt(r['draw'])} | {fmt(r['sync'])} | {fmt(r['update'])} |",
                flush=True,
            )
        print(
            "\n| steps | peer: cpprb PER sample(256), in-process ms "
            "| one Redis round trip (PING) ms |"
        )
        print("|---:|---:|---:|")
        for n in args.sizes:
            p = peers(server.url, n, args.repeats)
            cpprb = "not installed (the bench extra)" if p["cpprb"] is None else fmt(p["cpprb"])
            print(f"| {n:,} | {cpprb} | {fmt(p['ping'])} |", flush=True)
        if args.images:
            r = bench_images(server.url, args.images, max(10, args.repeats // 10))
            print(
                f"\n256 image transitions from {args.images:,} steps: plain commands "
                f"{fmt(r['plain'])} ms, inside the fetch script {fmt(r['lua'])} ms"
            )


if __name__ == "__main__":
    main()

"""Prefetch end to end: ingest and prefetch workers, a trainer popping augmented batches;
most with the broker (fill requests, ingest) on Redis and on RabbitMQ (``both_brokers``)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.store import Store
from orchestrator.delivery import shm
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.wire import is_batch as wire_is_batch
from orchestrator.delivery.wire import to_wire
from tests.support.stepdata import one_episode


def wire_bytes(*args, **kwargs) -> bytes:
    """A batch as queue bytes (what prefetch pushes when no shared memory is used)."""
    return to_wire(*args, **kwargs).tobytes()


def _frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 84, 84, 3), dtype=np.uint8)


def _ingest_images(url: str, broker: str, ns: str, frames: np.ndarray, episodes: int) -> None:
    ing = Ingestor(ns, url, broker_url=broker, flush_interval=None, flush_steps=128)
    per = len(frames) // episodes
    for e in range(episodes):
        with ing.episode(episode_id=f"e{e}", task_id="grasp") as ep:
            for t in range(per):
                i = e * per + t
                last = t == per - 1
                ep.add(
                    frames[i],
                    np.int64(t % 3),
                    float(t),
                    terminated=last,
                    next_obs=frames[i] if last else None,
                )
    assert ing.close().committed == per * episodes


def _is_replicate_shift(aug: np.ndarray, orig: np.ndarray, pad: int) -> bool:
    padded = np.pad(orig, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    h, w = orig.shape[:2]
    return any(
        np.array_equal(aug, padded[dy : dy + h, dx : dx + w])
        for dy in range(2 * pad + 1)
        for dx in range(2 * pad + 1)
    )


@pytest.mark.both_stores
@pytest.mark.both_brokers
def test_batches_arrive_augmented_and_consistent(redis_url, broker_url, namespace, workers):
    frames = _frames(240)
    _ingest_images(redis_url, broker_url, namespace, frames, episodes=4)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    recipe = client.register(
        {
            "name": "drq",
            "batch_size": 32,
            "fields": ["obs", "action", "reward", "next_obs", "terminated"],
            "sources": [{"name": "all", "where": {"task_id": "grasp"}}],
            "augment": {"obs": [{"random_shift": {"pad": 4}}], "next_obs": "same"},
            "prefetch": {"depth": 3},
        }
    )
    assert recipe.version == 1
    store = Store(redis_url, namespace)
    shifted = 0
    for _ in range(3):
        batch = client.pop("drq", timeout=60)
        assert batch["obs"].shape == (32, 84, 84, 3) and batch["obs"].dtype == np.uint8
        assert batch["action"].dtype == np.int64 and batch["reward"].shape == (32,)
        assert batch.recipe_version == 1 and np.all(batch.weights == 1)
        stored = store.get(batch.ids)
        np.testing.assert_array_equal(batch["action"], stored["action"])
        np.testing.assert_array_equal(batch["reward"], stored["reward"])
        for i in range(32):
            assert _is_replicate_shift(batch["obs"][i], stored["obs"][i], 4)
            assert _is_replicate_shift(batch["next_obs"][i], stored["next_obs"][i], 4)
            shifted += not np.array_equal(batch["obs"][i], stored["obs"][i])
    assert shifted > 80  # most rows really moved
    # Stored data untouched by augmentation.
    ep = store.episode("e1")
    np.testing.assert_array_equal(ep["obs"], frames[60:120])


def _ingest_vectors(url: str, broker: str, ns: str, n: int, start: int = 0) -> None:
    ing = Ingestor(ns, url, broker_url=broker, flush_interval=None, flush_steps=4096)
    ing.add_batch(
        {
            "obs": np.arange(start, start + n, dtype=np.float32)[:, None].repeat(8, 1),
            "action": np.zeros(n, np.int64),
            "reward": np.ones(n, np.float32),
            "episode_id": f"v{start}",
            "step_index": np.arange(n),
        }
    )
    assert ing.close().committed == n


# The two slowest tests here check what Redis does (priorities, the rate limiter's counts),
# not the broker, whose fill requests every other test sends through RabbitMQ too (and
# test_rabbitmq's update_priorities): Redis only, sharing the module's worker on it.
REDIS_BROKER = pytest.mark.both_brokers(brokers=["redis"])


def _vector_recipe(name: str, **extra) -> dict:
    return {
        "name": name,
        "batch_size": 64,
        "fields": ["obs", "reward"],
        "sources": [{"name": "all"}],
        "prefetch": {"depth": 2},
        **extra,
    }


@pytest.mark.both_stores
@REDIS_BROKER
def test_update_priorities_changes_what_is_sampled(redis_url, broker_url, namespace, workers):
    _ingest_vectors(redis_url, broker_url, namespace, 200)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    sampler = {"kind": "priority", "alpha": 1.0, "beta": 0.5}
    client.register(_vector_recipe("prio", sources=[{"name": "all", "sampler": sampler}]))
    first = client.pop("prio", timeout=60)
    ids = Store(redis_url, namespace).episode("v0", fields=[])["id"]
    favoured = ids[:10]
    pr = np.full(len(ids), 1e-6, np.float32)
    pr[:10] = 1.0
    assert client.update_priorities(ids, pr, wait=True) == 200
    version = client.set_params("prio").version  # drop batches sampled before the update
    rows = []
    while len(rows) < 10:
        b = client.pop("prio", timeout=60)
        if b.recipe_version == version:
            rows.append(b.ids)
    drawn = np.concatenate(rows)
    assert np.isin(drawn, favoured).mean() > 0.95
    assert np.isin(first.ids, favoured).mean() < 0.5
    assert np.all(np.isfinite(b.weights)) and b.weights.max() == pytest.approx(1.0)


@pytest.mark.both_brokers
def test_stalled_trainer_keeps_queue_at_its_bound(redis_url, broker_url, namespace, workers, r):
    _ingest_vectors(redis_url, broker_url, namespace, 300)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    client.register(_vector_recipe("stall", prefetch={"depth": 3}))
    client.pop("stall", timeout=60)  # above low water (1): no refill asked for yet
    queue = client.registry.queue("stall")
    client.request_fill("stall", force=True)  # as the beat safety net would
    deadline = time.monotonic() + 30
    while r.llen(queue) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(5):  # the trainer stalls; more refill requests arrive
        client.request_fill("stall", force=True)
        time.sleep(0.2)
        assert r.llen(queue) <= 3
    assert r.llen(queue) == 3
    # No thundering herd: while a fill is on its way, further requests send nothing.
    r.set(client.registry.refill_lock("stall"), 1)  # a fill in flight
    assert not any(client.request_fill("stall") for _ in range(50))
    r.delete(client.registry.refill_lock("stall"))
    assert client.request_fill("stall")  # none in flight: this one asks
    s = client.stats("stall")["stall"]
    assert s["depth"] == 3 and s["produced"] == 4 and s["popped"] == 1


@REDIS_BROKER
def test_rate_limiter_waits_then_resumes(redis_url, broker_url, namespace, workers):
    _ingest_vectors(redis_url, broker_url, namespace, 80)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    rl = {"samples_per_insert": 1.0, "min_size": 100, "error_buffer": 0}
    client.register(_vector_recipe("rl", rate_limit=rl, prefetch={"depth": 8}))
    with pytest.raises(TimeoutError, match="waiting for min_size: 80 of 100"):
        client.pop("rl", timeout=2)
    assert client.stats("rl")["rl"]["rate_limited"]
    _ingest_vectors(
        redis_url, broker_url, namespace, 220, start=1000
    )  # 300 inserted: 200 rows allowed
    got = [client.pop("rl", timeout=60) for _ in range(3)]
    assert all(len(b.ids) == 64 for b in got)
    with pytest.raises(TimeoutError, match=r"samples_per_insert 1\.0 reached"):
        client.pop("rl", timeout=2)
    # The same state from the command line.
    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    out = CliRunner().invoke(app, ["--redis-url", redis_url, "recipes", namespace, "--json"])
    assert out.exit_code == 0, out.output
    shown = json.loads(out.output)["rl"]
    assert shown["rate_limited"] and "samples_per_insert 1.0 reached" in shown["rate_limit"]
    assert shown["produced"] == 3
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from orchestrator.cli.exporter import ClawCollector

    registry = CollectorRegistry()
    registry.register(ClawCollector(redis_url, redis_url))
    text = generate_latest(registry).decode()
    assert f'claw_prefetch_rate_limited{{namespace="{namespace}",recipe="rl"}} 1.0' in text
    assert (
        f'claw_prefetch_batches_produced_total{{namespace="{namespace}",recipe="rl"}} 3.0' in text
    )
    s = client.stats("rl")["rl"]
    assert s["produced"] == 3 and s["sampled_rows"] == 192 and s["rate_limited"]
    _ingest_vectors(redis_url, broker_url, namespace, 100, start=5000)
    assert len(client.pop("rl", timeout=60).ids) == 64


@pytest.mark.both_brokers
def test_seeded_recipe_is_reproducible(redis_url, broker_url, namespace, workers):
    _ingest_vectors(redis_url, broker_url, namespace, 500)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    aug = {"obs": [{"gaussian_noise": {"std": 0.1}}]}
    a = client.register(_vector_recipe("a", seed=7, augment=aug))
    b = client.register(_vector_recipe("b", seed=7, augment=aug))
    assert a.version == b.version == 1
    for _ in range(2):
        x, y = client.pop("a", timeout=60), client.pop("b", timeout=60)
        np.testing.assert_array_equal(x.ids, y.ids)
        np.testing.assert_array_equal(x["obs"], y["obs"])
    c = client.register(_vector_recipe("c", seed=8, augment=aug))
    assert c.version == 1
    assert not np.array_equal(client.pop("c", timeout=60).ids, x.ids)


@pytest.mark.both_brokers
def test_unregister_and_timeout_message(redis_url, broker_url, namespace, workers):
    _ingest_vectors(redis_url, broker_url, namespace, 100)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    client.register(_vector_recipe("gone"))
    client.pop("gone", timeout=60)
    client.unregister("gone")
    with pytest.raises(KeyError, match="not registered"):
        client.pop("gone", timeout=1)


@pytest.mark.both_brokers
def test_llm_namespace_ragged_and_string_fields_pop(redis_url, broker_url, namespace, workers):
    from tests.stack.test_prefetch_fill import llm_store

    llm_store(redis_url, namespace)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    client.register(
        {
            "name": "llm",
            "batch_size": 8,
            "fields": ["prompt_ids", "reward", "task_id", "info"],
            "sources": [{"name": "all"}],
            "prefetch": {"depth": 2},
        }
    )
    batch = client.pop("llm", timeout=60)
    lengths = batch["prompt_ids_lengths"]
    assert batch["prompt_ids"].shape == (8, lengths.max())
    for i, reward in enumerate(batch["reward"].astype(int).tolist()):
        e, t = divmod(reward, 100)
        np.testing.assert_array_equal(
            batch["prompt_ids"][i, : lengths[i]], 100 * e + np.arange(t + 1)
        )
        assert batch.meta["task_id"][i] == f"task{e}"
        assert batch.meta["info"][i] == ({"seed": e, "note": f"start of e{e}"} if t == 0 else {})


def _images_store(url: str, ns: str, n: int = 64) -> Store:
    """Image steps without Celery: 16 of them make a batch big enough for /dev/shm."""
    store = Store(url, ns)
    store.create(capacity=1000)
    store.commit(one_episode(_frames(n), counted=True))
    return store


def _wait_full(r, queue: str, depth: int) -> None:
    deadline = time.monotonic() + 60
    while r.llen(queue) < depth:
        assert time.monotonic() < deadline, f"{queue} never reached {depth}"
        time.sleep(0.05)


@pytest.mark.both_brokers
def test_pop_drops_batches_of_older_versions(redis_url, broker_url, namespace, workers, r):

    _images_store(redis_url, namespace)
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    client.register(
        {
            "name": "v",
            "batch_size": 16,
            "fields": ["obs", "reward"],
            "sources": [{"name": "all"}],
            "prefetch": {"depth": 2},
        }
    )
    assert client.pop("v", timeout=60).recipe_version == 1
    assert client.set_params("v", k=1).version == 2
    # A fill that was still sampling version 1 pushes after the drain.
    late = wire_bytes({"reward": np.zeros(1, np.float32)}, [1], recipe_version=1)
    r.lpush(client.registry.queue("v"), late, late)
    assert [client.pop("v", timeout=60).recipe_version for _ in range(3)] == [2, 2, 2]
    other = BatchClient(
        namespace, redis_url, broker_url=broker_url
    )  # another process changes it again
    assert other.set_params("v", k=2).version == 3
    while (b := client.pop("v", timeout=60)).recipe_version != 3:
        assert b.recipe_version == 2  # older ones never
    r.lpush(client.registry.queue("v"), wire_bytes({}, [1], recipe_version=2))
    assert client.pop("v", timeout=60).recipe_version == 3
    other.unregister("v")  # registered anew elsewhere: versions start again at 1
    assert (
        other.register(
            {"name": "v", "batch_size": 16, "fields": ["obs"], "sources": [{"name": "all"}]}
        ).version
        == 1
    )
    assert client.pop("v", timeout=60).recipe_version == 1


@pytest.mark.both_brokers
def test_readers_on_two_hosts_share_a_recipe_inline(redis_url, broker_url, namespace, workers, r):
    _images_store(redis_url, namespace)
    spec = {
        "name": "mh",
        "batch_size": 16,
        "fields": ["obs"],
        "sources": [{"name": "all"}],
        "prefetch": {"depth": 2},
    }
    here = BatchClient(namespace, redis_url, broker_url=broker_url)
    queue = here.registry.queue("mh")
    assert here.register(spec).version == 1
    _wait_full(r, queue, 2)
    assert all(item.startswith(shm.REF_MAGIC) for item in r.lrange(queue, 0, -1))  # one host
    there = BatchClient(namespace, redis_url, broker_url=broker_url)
    there.host = "another-host"  # a rank of the same job on another machine
    assert there.register(spec).version == 1  # same recipe: no new version ...
    assert r.llen(queue) == 2  # ... and its batches stay
    assert here.register(spec).version == 1
    assert here.stats("mh")["mh"]["reader_hosts"] == 2
    refs = [here.pop("mh", timeout=60) for _ in range(2)]  # the shm ones, read here
    assert all(b["obs"].flags.writeable for b in refs)
    here.request_fill("mh", force=True)  # as the beat would, should a refill request meet a fill
    _wait_full(r, queue, 2)
    assert all(wire_is_batch(item) for item in r.lrange(queue, 0, -1))  # now inline
    # A reference to another host's /dev/shm is skipped (not raised, not fatal).
    forged = shm.reference_message("claw-1-2-x", 9, "other")
    r.lpush(queue, forged)
    assert there.pop("mh", timeout=60)["obs"].shape == (16, 84, 84, 3)

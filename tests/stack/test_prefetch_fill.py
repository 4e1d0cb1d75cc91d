"""The prefetch fill loop in this process (no Celery): collation of ragged fields, strings
and info, failures recorded in ``state``, stale pushes, the refill lock, shm reaping."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from claw_tasks.format.arrays import unpackb
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.store import Store
from claw_tasks.worker.context import forget
from orchestrator.delivery import prefetch, shm
from orchestrator.delivery.prefetch import fill, run_fill
from orchestrator.delivery.registry import Entry, Registry
from orchestrator.delivery.samplestats import Observed
from orchestrator.delivery.stages import Pipeline
from orchestrator.delivery.wire import to_wire
from orchestrator.recipe.model import Recipe
from orchestrator.recipe.options import Tokens
from orchestrator.transforms.augment import build_pipelines
from tests.support.llmturns import group_recipe, rollouts, turns_batch
from tests.support.paths import ROOT
from tests.support.stepdata import one_episode


def wire_bytes(*args, **kwargs) -> bytes:
    """A batch as queue bytes (what prefetch pushes when no shared memory is used)."""
    return to_wire(*args, **kwargs).tobytes()


def llm_store(url: str, ns: str, episodes: int = 3, length: int = 5) -> Store:
    """LLM-style steps: ragged int32 ``prompt_ids`` (row of step t of episode e: 100 * e +
    arange(t + 1)), no obs; string ``task_id`` and tag ``lang``; ``info`` on first steps;
    reward ``100 * e + t``."""
    store = Store(url, ns)
    store.create(capacity=1000)
    e, t = np.divmod(np.arange(episodes * length), length)
    b = StepBatch(
        episode=StrColumn.of([f"e{i}" for i in e]),
        step_index=t,
        reward=(100 * e + t).astype(np.float32),
        terminated=t == length - 1,
        truncated=np.zeros(len(t), bool),
        fields={
            "prompt_ids": Ragged.of(
                [100 * i + np.arange(k + 1) for i, k in zip(e, t, strict=True)], np.int32
            )
        },
        info_rows=np.flatnonzero(t == 0).astype(np.int32),
        info=[{"seed": int(i), "note": f"start of e{i}"} for i in range(episodes)],
    )
    b.strs["task_id"] = StrColumn.of([f"task{i}" for i in e])
    b.strs["t:lang"] = StrColumn.of(["en" if i % 2 else None for i in e])
    store.commit(b)
    return store


def recipe(name: str, fields: list[str], **kw) -> Recipe:
    return Recipe.model_validate(
        {
            "name": name,
            "batch_size": 8,
            "fields": fields,
            "sources": [{"name": "all"}],
            "prefetch": {"depth": 2},
            **kw,
        }
    )


def queued(reg: Registry, name: str) -> list:
    return [shm.from_message(item) for item in reg.drain(name)]


def test_a_layout_casts_fields_and_puts_each_parts_rows_together(redis_url, namespace):
    """The recipe's ``layout``: fields arrive in the dtypes it names, and part j (rows
    j::parts as drawn, the sources' mix) is rows j*m:(j+1)*m of the delivered batch."""
    from orchestrator.sampling.batch import part_order

    reg = Registry(llm_store(redis_url, namespace))
    sources = [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]
    layout = {"dtypes": {"terminated": "float32", "reward": "int64"}, "parts": 4}
    reg.put(
        recipe("laid", ["reward", "terminated", "task_id"], sources=sources, layout=layout), None
    )
    assert run_fill(reg, "laid") == {"made": 2, "state": "ok"}
    for batch in queued(reg, "laid"):
        assert batch["terminated"].dtype == np.float32 and batch["reward"].dtype == np.int64
        e, t = np.divmod(batch["reward"], 100)
        assert batch["terminated"].tolist() == (t == 4).astype(np.float32).tolist()
        assert batch.meta["task_id"] == [f"task{i}" for i in e]  # meta in the same order
        drawn = np.repeat(np.arange(2, dtype=np.int16), [6, 2])  # sources one after another
        np.testing.assert_array_equal(batch.source_index, drawn[part_order(8, 4)])


def test_ragged_fields_strings_and_info_are_collated(redis_url, namespace):
    reg = Registry(llm_store(redis_url, namespace))
    fields = ["prompt_ids", "reward", "task_id", "episode_id", "tags.lang", "info"]
    reg.put(recipe("llm", fields), None)
    assert run_fill(reg, "llm") == {"made": 2, "state": "ok"}
    for batch in queued(reg, "llm"):
        ids, lengths = batch["prompt_ids"], batch["prompt_ids_lengths"]
        assert ids.dtype == np.int32 and lengths.dtype == np.int32 and lengths.shape == (8,)
        assert ids.shape == (8, lengths.max())
        for i, reward in enumerate(batch["reward"].astype(int).tolist()):
            e, t = divmod(reward, 100)
            np.testing.assert_array_equal(ids[i, : lengths[i]], 100 * e + np.arange(t + 1))
            assert not ids[i, lengths[i] :].any()  # zero padding
            assert batch.meta["task_id"][i] == f"task{e}"
            assert batch.meta["episode_id"][i] == f"e{e}"
            assert batch.meta["tags.lang"][i] == ("en" if e % 2 else None)
            assert batch.meta["info"][i] == (
                {"seed": e, "note": f"start of e{e}"} if t == 0 else {}
            )
        with pytest.raises(KeyError, match=r"batch.meta\['task_id'\]"):
            batch["task_id"]
    reg.put(recipe("seq", ["prompt_ids", "task_id", "reward"], sequence_length=2), None)
    assert run_fill(reg, "seq")["state"] == "ok"
    batch = queued(reg, "seq")[0]
    lengths = batch["prompt_ids_lengths"]
    assert lengths.shape == (8, 2) and batch["prompt_ids"].shape == (8, 2, lengths.max())
    assert (lengths[:, 1] == lengths[:, 0] + 1).all()  # consecutive steps of one episode
    assert [len(w) for w in batch.meta["task_id"]] == [2] * 8


def test_sample_and_pop_give_one_batch_type(redis_url, namespace):
    """What ``orchestrator.sample`` returns and what a trainer pops are one type: ``len()``
    is its rows, strings and ``info`` are in ``meta`` on both paths."""
    from orchestrator import Batch, sample
    from orchestrator.delivery.client import BatchClient

    store = llm_store(redis_url, namespace)
    spec = recipe("one", ["prompt_ids", "reward", "task_id", "info"])
    drawn = sample(store, spec, rng=np.random.default_rng(0))
    with BatchClient(namespace, redis_url) as client:
        client.registry.put(spec, None)
        assert run_fill(client.registry, "one")["state"] == "ok"
        popped = client.pop("one", timeout=5)
    assert list(drawn) == ["prompt_ids", "reward"]  # ragged rows as drawn: a list of arrays
    assert list(popped) == ["prompt_ids", "prompt_ids_lengths", "reward"]  # padded
    for b in (drawn, popped):
        assert type(b) is Batch and len(b) == len(b.ids) == len(b.weights) == 8
        assert b.sources == ("all",) and b.recipe_version == spec.version
        assert set(b.meta) == {"task_id", "info"}
        for i, reward in enumerate(b["reward"].astype(int).tolist()):
            e, t = divmod(reward, 100)
            assert b.meta["task_id"][i] == f"task{e}"
            assert b.meta["info"][i] == ({"seed": e, "note": f"start of e{e}"} if t == 0 else {})
        with pytest.raises(KeyError, match=r"batch.meta\['task_id'\]"):
            b["task_id"]


def test_any_failure_of_a_fill_is_recorded(redis_url, namespace):
    reg = Registry(llm_store(redis_url, namespace))
    bad = recipe("bad", ["prompt_ids"], augment={"prompt_ids": [{"gaussian_noise": {"std": 1}}]})
    reg.put(bad, None)  # ragged rows cannot be augmented as one array
    out = run_fill(reg, "bad")
    assert out["made"] == 0 and out["state"].startswith("error: ValueError: augment 'prompt_ids'")
    assert reg.counts("bad")["state"] == out["state"]
    clash = recipe("clash", ["prompt_ids", "obs"])
    reg.put(clash, None)  # the stored recipe no longer fits the namespace
    assert run_fill(reg, "clash")["state"].startswith("error: RecipeError")
    assert reg.counts("clash")["state"].startswith("error: RecipeError")


def test_augmentation_state_survives_new_versions(redis_url, namespace):
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    n = 50
    store.commit(one_episode(np.ones((n, 3), np.float32)))
    reg = Registry(store)
    v1 = recipe("norm", ["obs"], augment={"obs": [{"running_normalize": None}]})
    reg.put(v1, None)
    run_fill(reg, "norm")

    def seen() -> int:  # rows the shared statistics have observed
        return unpackb(reg.r.hget(reg.augment_stats("norm"), "obs/0"))["count"]

    assert seen() == 16  # two batches of 8 observed
    for version in (2, 3):  # as set_params makes them
        reg.put(v1.model_copy(update={"version": version, "params": {"v": version}}), None)
        reg.drain("norm")
        run_fill(reg, "norm")
    assert seen() == 16 + 32
    forget(namespace, dropped=False)  # a restarted worker: nothing cached ...
    reg.drain("norm")
    run_fill(reg, "norm")
    assert seen() == 16 + 32 + 16  # ... carries on from the shared statistics
    clipped = v1.model_copy(update={"augment": {"obs": [{"running_normalize": {"clip": 5}}]}})
    reg.put(clipped.model_copy(update={"version": 4}), None)  # another augment section
    reg.drain("norm")
    run_fill(reg, "norm")
    assert seen() == 16  # starts afresh
    reg.remove("norm")
    assert not reg.r.exists(reg.augment_stats("norm"))


def test_push_of_a_stale_version_is_taken_back(redis_url, namespace):
    reg = Registry(llm_store(redis_url, namespace))
    v1 = recipe("r", ["prompt_ids"])
    reg.put(v1, None)
    assert run_fill(reg, "r")["made"] == 2
    counts = reg.counts("r")
    reg.put(v1.model_copy(update={"version": 2}), None)  # set_params while a fill samples
    reg.drain("r")
    stale = to_wire({}, [1], recipe_version=1).tobytes()
    assert prefetch.push(reg, v1, stale) == "stale"
    assert reg.r.llen(reg.queue("r")) == 0
    assert reg.counts("r") == counts  # produced and sampled not counted
    fresh = to_wire({}, [1], recipe_version=2).tobytes()
    assert prefetch.push(reg, v1.model_copy(update={"version": 2}), fresh) == 1


def test_a_token_recipe_under_a_rate_limit_fills_its_depth(redis_url, namespace):
    """The rate limit counts a token batch as its ``batch_size`` rows drawn, whatever
    number of sequences the batch was cut into."""
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    store.commit(turns_batch(rollouts(3, 2, 1, seed=0)))
    reg = Registry(store)
    tokens = recipe(
        "tok",
        ["prompt_ids", "response_ids", "response_logprobs"],
        batch_size=4,
        tokens={},
        rate_limit={"samples_per_insert": 100.0},
    )
    reg.put(tokens, None)
    assert run_fill(reg, "tok") == {"made": 2, "state": "ok"}
    batches = queued(reg, "tok")
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4]
    assert reg.counts("tok")["sampled"] == 8


def test_a_recipe_gets_the_stages_its_sections_ask_for(redis_url, namespace):
    store = Store(redis_url, namespace)

    def stages(rec: Recipe) -> list[str]:
        plan = build_pipelines(rec.augment) if rec.augment else None
        pipeline = Pipeline.of(store, Entry(rec, frozenset(), 0.0), plan, Observed())
        return [type(s).__name__ for s in pipeline.stages]

    ends = ["Deliver", "Observe"]
    assert stages(recipe("p", ["obs"])) == ["Draw", "Collate", *ends]
    shift = {"obs": [{"random_shift": {"pad": 4}}]}
    assert stages(recipe("a", ["obs"], augment=shift)) == ["Draw", "AugmentInto", "Collate", *ends]
    nearest = recipe("n", ["obs"], nearest={}, params={"policy_version": 0}, admission={})
    assert stages(nearest) == ["Draw", "CountStaleness", "AttachNearest", "Collate", *ends]
    grouped = group_recipe()
    assert stages(grouped) == ["Draw", "Collate", "AttachGroups", *ends]
    tokens = grouped.model_copy(update={"tokens": Tokens(advantage="grpo"), "augment": shift})
    assert stages(tokens) == ["Draw", "Augment", "CollateTokens", *ends]
    two = [{"name": "a"}, {"name": "b"}]
    laid = recipe("l", ["obs"], sources=two, augment=shift, layout={"parts": 2})
    assert stages(laid) == ["Draw", "PartOrder", "AugmentInto", "Collate", *ends]
    one = recipe("o", ["obs"], augment=shift, layout={"parts": 2})  # one source: any order
    assert stages(one) == ["Draw", "AugmentInto", "Collate", *ends]
    cast = recipe("c", ["obs"], augment=shift, layout={"dtypes": {"obs": "float32"}})
    assert stages(cast) == ["Draw", "Augment", "Collate", "Cast", *ends]  # cast after it


@pytest.fixture
def in_process_fill(redis_url, monkeypatch):
    """``prefetch.fill`` run here, against the test's Redis."""
    monkeypatch.setattr(prefetch, "store_for", lambda ns: Store(redis_url, ns))
    return fill


def test_fill_releases_only_its_own_refill_lock(redis_url, namespace, in_process_fill):
    reg = Registry(llm_store(redis_url, namespace))
    reg.put(recipe("r", ["prompt_ids"]), None)
    mine = reg.take_refill_lock("r")
    assert mine is not None and reg.take_refill_lock("r") is None
    reg.r.delete(reg.refill_lock("r"))  # expired while the fill ran ...
    theirs = reg.take_refill_lock("r")  # ... and the next fill took it
    in_process_fill(namespace, "r", mine)
    assert reg.r.get(reg.refill_lock("r")).decode() == theirs
    in_process_fill(namespace, "r", theirs)
    assert not reg.r.exists(reg.refill_lock("r"))


def orphan_segment() -> Path:
    """A segment whose creator has exited, written a minute ago."""
    code = (
        "import numpy as np\nfrom orchestrator.delivery import shm\n"
        "from orchestrator.delivery.wire import to_wire\n"
        "print(shm.write_segment(to_wire({'x': np.arange(3)}, ids=range(3))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True)
    path = shm.SHM_DIR / out.stdout.decode().strip()
    old = time.time() - 60
    os.utime(path, (old, old))
    return path


@pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="needs /dev/shm")
def test_fill_reaps_orphaned_segments_at_most_once_a_minute(
    redis_url, namespace, in_process_fill, monkeypatch
):
    reg = Registry(llm_store(redis_url, namespace))
    reg.put(recipe("r", ["prompt_ids"]), None)
    monkeypatch.setattr(prefetch, "_last_reap", -math.inf)
    made = [orphan_segment(), orphan_segment()]
    try:
        in_process_fill(namespace, "r", reg.take_refill_lock("r"))
        assert not any(p.exists() for p in made)
        made.append(orphan_segment())
        in_process_fill(namespace, "r", reg.take_refill_lock("r"))  # within the minute: not again
        assert made[-1].exists()
    finally:
        for p in made:
            p.unlink(missing_ok=True)


def test_collate_edge_cases():
    from orchestrator.delivery.collate import collate
    from orchestrator.delivery.wire import decode_batch
    from orchestrator.sampling.batch import Batch

    empty = [np.zeros((0, 2), np.float32)] * 3  # every row empty: (B, 0, 2)
    arrays = collate({"x": empty})
    assert arrays["x"].shape == (3, 0, 2) and arrays["x_lengths"].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="'x_lengths' is a field of the recipe too"):
        collate({"x": empty, "x_lengths": np.zeros(3)})
    with pytest.raises(ValueError, match="differ in dtype or trailing shape"):
        collate({"x": [np.zeros(2, np.int32), np.zeros(2, np.int64)]})
    with pytest.raises(TypeError, match="belong in meta"):
        collate({"s": np.array(["a", None], dtype=object)})
    drawn = Batch.drawn(
        {
            "x": [np.arange(2), np.arange(1)],
            "s": np.array(["a", None], dtype=object),
            "info": [{"a": 1}, {}],
        },
        np.array([1, 2]),
        np.ones(2, np.float32),
        np.zeros(2, np.int16),
        ("all",),
        1,
    )
    assert list(drawn) == ["x"] and drawn.meta == {"s": ["a", None], "info": [{"a": 1}, {}]}
    out = decode_batch(wire_bytes(collate(drawn.fields), drawn.ids, meta=drawn.meta))
    assert out["x"].tolist() == [[0, 1], [0, 0]] and out["x_lengths"].tolist() == [2, 1]
    assert out.meta == drawn.meta and len(out) == len(drawn) == 2


def test_pop_refuses_a_batch_of_an_unknown_wire_version(redis_url, namespace):
    """A trainer older than the workers gets an error naming both versions, not a misread."""
    from orchestrator.delivery.client import BatchClient
    from orchestrator.delivery.wire import VERSION, WireVersionError

    llm_store(redis_url, namespace)
    with BatchClient(namespace, redis_url) as client:
        client.registry.put(recipe("r", ["prompt_ids"]), None)  # no fill: the queue is ours
        item = wire_bytes({"reward": np.zeros(8, np.float32)}, np.arange(8), recipe_version=1)
        newer = item[:4] + (VERSION + 1).to_bytes(4, "little") + item[8:]
        client.store.r.rpush(client.registry.queue("r"), newer, item)
        with pytest.raises(WireVersionError, match=f"version {VERSION + 1}, this reader reads"):
            client.pop("r", timeout=5)
        assert len(client.pop("r", timeout=5)) == 8  # the next one reads fine


@pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="needs /dev/shm")
def test_batches_augmented_in_their_segment_equal_those_sent_inline(redis_url, namespace):
    """Augmenting straight into a reused segment's mapping gives what the inline path
    gives for the same seed."""
    n = 64
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    frames = np.random.default_rng(0).integers(0, 256, (n, 84, 84, 3), np.uint8)
    store.commit(one_episode(frames, counted=True))
    reg = Registry(store)
    augment = {
        "obs": [{"random_shift": {"pad": 4}}, {"color_jitter": {"brightness": 0.3, "p": 0.5}}],
        "next_obs": "same",
    }
    fields = ["obs", "next_obs", "reward"]
    reg.put(recipe("here", fields, seed=3, augment=augment), shm.host_id())  # 339 KB batches
    reg.put(recipe("inline", fields, seed=3, augment=augment), None)
    shm.release_pool()
    got: dict[str, list] = {"here": [], "inline": []}
    inodes = []
    for _ in range(3):  # each round fills both queues (depth 2), then reads and drops them
        for name, batches in got.items():
            assert run_fill(reg, name) == {"made": 2, "state": "ok"}
            items = reg.drain(name)
            if name == "here":
                inodes += [(shm.SHM_DIR / shm.reference_of(i)["name"]).stat().st_ino for i in items]
            for item in items:  # copied, so the segment is free once read
                batch = shm.from_message(item)
                batches.append({"ids": batch.ids.copy(), **{f: batch[f].copy() for f in fields}})
                del batch
            gc.collect()
    assert len(got["here"]) == 6 and len(set(inodes)) == 2  # segments reused: filled in place
    for a, b in zip(got["here"], got["inline"], strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

"""Replay (``claw replay``, :mod:`orchestrator.inspect.replay`): a trainer pops prioritized,
n-step, frame-stacked, augmented batches (and sequence windows) from real prefetch workers
and sets priorities between pops, as a DQN does; the lineage log then gives every batch
back bit for bit, in order (fields, augmented pixels, ids, weights, meta) while its steps
are in Redis and, once they are evicted, from the Parquet archive; steps evicted and never
archived are reported by row, never made up; recipe versions are kept while the log names
them."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from orchestrator.cli.main import app
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import Entry, LineageLog, Replayable, digest, record
from orchestrator.delivery.registry import Registry
from orchestrator.inspect.replay import Replayer, replay
from orchestrator.maintenance.archive import archive_namespace
from orchestrator.maintenance.archive_files import Manifest
from orchestrator.maintenance.restore import find_archive
from orchestrator.recipe.model import Recipe, recipe_digest
from orchestrator.sampling.batch import Batch

EPISODES, LENGTH = 6, 20


def episodes(first: int, count: int, task: str) -> StepBatch:
    """``count`` episodes of ``LENGTH`` steps, 16x16 grey frames of seeded noise (a stack
    of three has three channels), the last step terminated, rewards naming the step."""
    rng = np.random.default_rng(first)
    n = count * LENGTH
    ep = np.repeat(np.arange(first, first + count), LENGTH)
    t = np.tile(np.arange(LENGTH), count)
    b = StepBatch(
        episode=StrColumn.of([f"ep{e}" for e in ep.tolist()]),
        step_index=t,
        reward=(ep + t / 100).astype(np.float32),
        terminated=t == LENGTH - 1,
        truncated=np.zeros(n, bool),
        fields={
            "obs": rng.integers(1, 256, (n, 16, 16, 1), dtype=np.uint8),
            "action": (t % 3).astype(np.int64),
        },
    )
    b.strs["task_id"] = StrColumn.constant(task, n)
    return b


RECIPE = {
    "name": "dqn",
    "batch_size": 32,
    "fields": ["obs", "action", "reward", "next_obs", "task_id"],
    "sources": [
        {
            "name": "replay",
            "where": "task_id == 'play'",
            "sampler": {"kind": "priority", "alpha": 0.6, "beta": 0.4},
        }
    ],
    "n_step": 3,
    "gamma": 0.9,
    "frame_stack": 3,
    "prefetch": {"depth": 2},
    "augment": {
        "obs": [
            {"random_shift": {"pad": 2}},
            {"color_jitter": {"brightness": 0.3, "contrast": 0.3, "p": 0.8}},
            {"albumentations": {"GaussNoise": {"p": 1.0}}},
        ],
        "next_obs": "same",
    },
}


def kept(batch: Batch) -> Batch:
    """A popped batch's arrays copied out of its shared-memory segment."""
    return Batch(
        {k: np.array(v) for k, v in batch.fields.items()},
        np.array(batch.ids),
        np.array(batch.weights),
        np.array(batch.source_index),
        batch.sources,
        batch.recipe_version,
        json.loads(json.dumps(batch.meta)),
        seed=batch.seed,
        recipe_digest=batch.recipe_digest,
    )


def assert_same(got: Batch, want: Batch) -> None:
    """Bit for bit: field names in order, dtypes, shapes, bytes; ids, weights, sources,
    meta."""
    assert list(got.fields) == list(want.fields)
    for k, v in want.fields.items():
        g = np.asarray(got.fields[k])
        assert (g.dtype, g.shape) == (v.dtype, v.shape), k
        assert g.tobytes() == v.tobytes(), k
    for k in ("ids", "weights", "source_index"):
        g, v = getattr(got, k), getattr(want, k)
        assert g.dtype == v.dtype and g.tobytes() == v.tobytes(), k
    assert got.sources == want.sources and got.recipe_version == want.recipe_version
    assert json.loads(json.dumps(got.meta)) == want.meta


def train(client: BatchClient, updates: int, first_policy: int) -> list[Batch]:
    """Pop ``updates`` batches as a DQN would, declaring policy versions, each followed by
    new priorities for its rows (so later batches weigh their rows unevenly)."""
    rng = np.random.default_rng(first_policy)
    seen = []
    for v in range(first_policy, first_policy + updates):
        b = client.pop("dqn", timeout=60, policy_version=v)
        seen.append(kept(b))
        client.update_priorities(b.ids, rng.uniform(0.01, 5.0, len(b)))
    client.flush_lineage()
    return seen


def test_replay_gives_back_every_batch_from_redis_and_the_archive(
    redis_url, namespace, start_worker, tmp_path
):
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(episodes(0, EPISODES, "play"))
    start_worker("prefetch", 1)
    client = BatchClient(namespace, redis_url)
    client.register(RECIPE)
    seen = train(client, 6, 1)
    client.close()
    assert any(len(np.unique(b.weights)) > 1 for b in seen), "weights all equal: no test"
    assert all(b.seed is not None for b in seen)

    log = LineageLog(store)
    entries = [e for v in range(1, 7) for e in log.trained(v)]
    assert [e.batch_ids.tolist() for e in entries] == [b.ids.tolist() for b in seen]

    # From Redis, in order.
    got = [r for v in range(1, 7) for r in replay(store, policy=v)]
    assert [r.source for r in got] == ["redis"] * 6
    for r, want in zip(got, seen, strict=True):
        assert r.batch is not None, r.missing
        assert_same(r.batch, want)

    # Archived, then evicted: from the archive.
    archive_namespace(store, tmp_path / "arch")
    alive = store.get(np.arange(1, EPISODES * LENGTH + 1), fields=["action"])
    assert len(alive["action"]) == EPISODES * LENGTH
    assert store.evict(np.arange(1, EPISODES * LENGTH + 1)) == EPISODES * LENGTH
    got = list(replay(store, start="-", end="+", archive=tmp_path / "arch"))
    assert [r.source for r in got] == ["archive"] * 6
    for r, want in zip(got, seen, strict=True):
        assert r.batch is not None, r.missing
        assert_same(r.batch, want)
    # The scratch namespace the archive was restored into is gone.
    assert not [k for k in store.r.scan_iter(match=f"*{namespace}.replay-*")]

    # The CLI: same verdict, batches written out.
    args = ["--archive", str(tmp_path / "arch"), "--out", str(tmp_path / "out"), "--json"]
    out = CliRunner().invoke(
        app, ["--redis-url", redis_url, "replay", namespace, "--policy", "3", *args]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["inexact"] == 0 and doc["batches"][0]["source"] == "archive"
    saved = np.load(tmp_path / "out" / f"{doc['batches'][0]['entry']}.npz")
    assert saved["field.obs"].tobytes() == seen[2]["obs"].tobytes()
    assert saved["weights"].tobytes() == seen[2].weights.tobytes()


def test_replay_names_rows_evicted_and_never_archived(redis_url, namespace, start_worker, tmp_path):
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(episodes(0, 2, "old"))
    archive_namespace(store, tmp_path / "arch")  # holds the "old" steps only
    store.commit(episodes(10, EPISODES, "play"))
    start_worker("prefetch", 1)
    client = BatchClient(namespace, redis_url)
    client.register(RECIPE)
    seen = train(client, 2, 1)
    client.close()
    store.evict(np.unique(seen[0].ids[:5]))  # a few rows of the first batch

    first, second = list(replay(store, archive=tmp_path / "arch"))
    assert first.batch is None and first.source == ""
    missing = {m.reason: m for m in first.missing}
    gone = np.isin(seen[0].ids, seen[0].ids[:5])
    evicted = missing["evicted from Redis and never archived"]
    assert evicted.rows.tolist() == np.flatnonzero(gone).tolist()
    assert evicted.ids.tolist() == seen[0].ids[gone].tolist()
    # Rows whose n-step return or frame stack runs through an evicted step: named apart.
    chain = "a step its assembly follows was evicted from Redis and never archived"
    if chain in missing:
        assert not np.isin(missing[chain].rows, evicted.rows).any()
    assert set(missing) <= {evicted.reason, chain}
    if second.batch is not None:  # none of its rows reads an evicted step
        assert_same(second.batch, seen[1])
    else:
        assert {m.reason for m in second.missing} <= {evicted.reason, chain}

    # Without an archive: said so.
    (alone,) = [r for r in replay(store, policy=1)]
    assert alone.missing[0].reason.endswith("no archive was given")

    # A recipe version no longer kept: every row, and why.
    reg = Registry(store)
    store.r.hdel(reg.definitions_key, seen[1].recipe_digest)
    (last,) = list(replay(store, policy=2))
    assert last.batch is None and "is no longer kept" in last.missing[0].reason
    assert last.missing[0].rows.tolist() == list(range(len(seen[1])))

    out = CliRunner().invoke(app, ["--redis-url", redis_url, "replay", namespace])
    assert out.exit_code == 1 and "2 not replayed exactly" in out.output
    bad = CliRunner().invoke(app, ["--redis-url", redis_url, "replay", namespace, "--from", "x"])
    assert bad.exit_code == 2 and "--from: a lineage entry id" in bad.output


@pytest.mark.both_stores
def test_recipe_versions_are_kept_while_the_log_names_them(redis_url, namespace):
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    reg, log = Registry(store), LineageLog(store)
    base = {"name": "r", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
    versions = [Recipe.model_validate({**base, "version": v, "gamma": v / 10}) for v in (1, 2, 3)]
    for recipe in versions:
        reg.put(recipe, None)
    d1, d2, d3 = (recipe_digest(r) for r in versions)
    # Live params set every update make no definition to keep: they only choose the draw.
    for v in (4, 5):
        reg.put(versions[2].model_copy(update={"version": v, "params": {"k": v}}), None)
    assert store.r.hlen(reg.definitions_key) == 3
    with store.r.pipeline(transaction=False) as pipe:  # a batch of version 1 was trained on
        log.queue(pipe, record("r", 1, 7, np.arange(1, 5), None, Replayable(recipe_digest=d1)))
        pipe.execute()
    log.build_index(force=True)  # the entry is in a segment: its table names d1
    assert log.recipe_digests() == {d1}
    # Within the grace nothing goes; past it, version 2 (neither named nor current).
    assert reg.prune_definitions(log.recipe_digests()) == 0
    assert reg.prune_definitions(log.recipe_digests(), grace=0) == 1
    assert reg.definition(d2) is None
    assert reg.definition(d1) == versions[0] and recipe_digest(reg.definition(d3)) == d3
    # The log trims the entry (CLAW_LINEAGE_MAXLEN): version 1 goes with it.
    store.r.xtrim(log.key, maxlen=0)
    log.build_index()
    assert log.recipe_digests() == set()
    assert reg.prune_definitions(log.recipe_digests(), grace=0) == 1
    assert reg.definition(d1) is None and recipe_digest(reg.definition(d3)) == d3


def test_replay_restores_more_archive_files_as_later_batches_need_them(
    redis_url, namespace, tmp_path
):
    """Batches from the archive's first files, then its last (the scratch namespace grows:
    restored again, nothing overwritten), then the first again."""
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(episodes(0, 10, "play"))
    recipe = Recipe.model_validate(
        {"name": "plain", "batch_size": 4, "fields": ["obs", "reward"], "sources": [{"name": "a"}]}
    )
    Registry(store).put(recipe, None)
    ids = np.arange(1, 10 * LENGTH + 1)
    stored = store.get(ids, fields=["obs"])["obs"]
    archive_namespace(store, tmp_path / "arch", chunk_bytes=16 * 16 * 10)  # files of ~10 steps
    assert store.evict(ids) == len(ids)

    def entry(rows: list[int]) -> Entry:
        got = np.array(rows, np.int64)
        return Entry(
            "1-0",
            "plain",
            1,
            "",
            len(got),
            digest(got),
            0.0,
            np.sort(got),
            np.argsort(np.argsort(got)),
            recipe_digest=recipe_digest(recipe),
        )

    with Replayer(store, tmp_path / "arch") as replayer:
        for rows in ([3, 1, 2, 2], [199, 200, 150, 198], [1, 2, 3, 4]):
            got = replayer.replay(entry(rows))
            assert got.source == "archive" and got.batch is not None, got.missing
            assert got.batch.ids.tolist() == rows
            assert got.batch["obs"].tobytes() == stored[np.array(rows) - 1].tobytes()
        assert replayer.capacity > 2 * 30  # grown past its first files

    # Bounded: the files of one batch at most (earlier batches' dropped to make room); a
    # batch whose files alone pass the bound is reported, nothing restored for it.
    files = Manifest.load(find_archive(tmp_path / "arch")).files
    bound = 5 * max(int(f["bytes"]) for f in files)
    with Replayer(store, tmp_path / "arch", max_restore=bound) as replayer:
        for rows in ([3, 1, 2, 2], [199, 200, 150, 198], [1, 2, 3, 4]):
            got = replayer.replay(entry(rows))
            assert got.batch is not None, got.missing
            assert got.batch["obs"].tobytes() == stored[np.array(rows) - 1].tobytes()
            assert sum(int(f["bytes"]) for f in replayer.restored.values()) <= bound
        wide = replayer.replay(entry([1, 50, 100, 150, 200]))
        assert wide.batch is None and "max_restore" in wide.missing[0].reason
        assert wide.missing[0].rows.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.both_stores
def test_sequence_batches_replay_from_redis_and_the_archive(
    redis_url, namespace, start_worker, tmp_path
):
    """Windows of 5 steps (a window stops at its episode's end), shifted as one."""
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(episodes(0, 4, "play"))
    start_worker("prefetch", 1)
    client = BatchClient(namespace, redis_url)
    client.register(
        {
            "name": "seq",
            "batch_size": 8,
            "fields": ["obs", "action", "reward"],
            "sources": [{"name": "all"}],
            "sequence_length": 5,
            "prefetch": {"depth": 1},
            "augment": {"obs": [{"random_shift": {"pad": 2}}]},
        }
    )
    seen = [kept(client.pop("seq", timeout=60, policy_version=v)) for v in range(3)]
    client.close()
    assert seen[0]["obs"].shape == (8, 5, 16, 16, 1)
    for r, want in zip(replay(store), seen, strict=True):
        assert r.source == "redis" and r.batch is not None, r.missing
        assert_same(r.batch, want)
    archive_namespace(store, tmp_path / "arch")
    store.evict(np.arange(1, 4 * LENGTH + 1))
    for r, want in zip(replay(store, archive=tmp_path / "arch"), seen, strict=True):
        assert r.source == "archive" and r.batch is not None, r.missing
        assert_same(r.batch, want)


def test_laid_out_batches_replay_bit_for_bit(redis_url, namespace, start_worker):
    """A recipe's layout (rows in part order, a field cast) is replayed as delivered: the
    rows are drawn and augmented in the order the trainer got them, the field cast."""
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(episodes(0, 4, "play"))
    start_worker("prefetch", 1)
    client = BatchClient(namespace, redis_url)
    client.register(
        {
            "name": "laid",
            "batch_size": 8,
            "fields": ["obs", "action", "reward"],
            "sources": [{"name": "a", "weight": 3}, {"name": "b"}],
            "prefetch": {"depth": 1},
            "augment": {"obs": [{"random_shift": {"pad": 2}}]},
            "layout": {"dtypes": {"reward": "float64"}, "parts": 2},
        }
    )
    seen = [kept(client.pop("laid", timeout=60, policy_version=v)) for v in range(3)]
    client.close()
    assert seen[0]["reward"].dtype == np.float64
    assert seen[0].source_index.tolist() == [0, 0, 0, 1, 0, 0, 0, 1]  # each part: 3 a, 1 b
    for r, want in zip(replay(store), seen, strict=True):
        assert r.source == "redis" and r.batch is not None, r.missing
        assert_same(r.batch, want)


def test_the_scratch_namespace_is_never_one_that_exists(
    redis_url, namespace, tmp_path, monkeypatch
):
    """A scratch name that a namespace already has (here forced) is passed over: that
    namespace keeps its steps, the replay takes another name and drops only that one."""
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(episodes(0, 2, "play"))
    recipe = Recipe.model_validate(
        {"name": "plain", "batch_size": 2, "fields": ["obs"], "sources": [{"name": "a"}]}
    )
    Registry(store).put(recipe, None)
    archive_namespace(store, tmp_path / "arch")
    assert store.evict(np.arange(1, 2 * LENGTH + 1)) == 2 * LENGTH
    theirs = Store(redis_url, f"{namespace}.replay-taken")
    theirs.create(capacity=2 * 2 * LENGTH)  # the size a scratch namespace would take
    theirs.commit(episodes(50, 1, "theirs"))
    names = iter([theirs.namespace, f"{namespace}.replay-free"])
    monkeypatch.setattr("orchestrator.inspect.replay.scratch_name", lambda ns: next(names))

    entry = Entry(
        "1-0",
        "plain",
        1,
        "",
        2,
        digest(np.array([1, 2])),
        0.0,
        np.array([1, 2]),
        recipe_digest=recipe_digest(recipe),
    )
    with Replayer(store, tmp_path / "arch") as replayer:
        got = replayer.replay(entry)
        assert got.source == "archive" and got.batch is not None, got.missing
        assert replayer.scratch is not None
        assert replayer.scratch.namespace == f"{namespace}.replay-free"
        # An entry whose recorded order does not give back its ids' digest: refused.
        swapped = replayer.replay(replace(entry, digest=digest(np.array([2, 1]))))
        assert swapped.batch is None and "does not match" in swapped.missing[0].reason
    assert theirs.exists() and theirs.count() == LENGTH
    assert not Store(redis_url, f"{namespace}.replay-free").exists()


def test_the_cli_refuses_bad_entry_ids_and_two_selections(redis_url, namespace):
    Store(redis_url, namespace).create(capacity=10)
    for args, message in (
        (["--from", "1-x"], "--from: a lineage entry id"),
        (["--to", "18446744073709551616-0"], "--to: a lineage entry id"),  # 2**64
        (["--policy", "3", "--from", "1-0"], "--policy: or --from/--to, not both"),
    ):
        out = CliRunner().invoke(app, ["--redis-url", redis_url, "replay", namespace, *args])
        assert out.exit_code == 2 and message in out.output, out.output
        assert "Traceback" not in out.output

"""Snapshots and rollback on a real Redis: labels, priorities, tags, recipes and params come
back bit for bit; steps evicted since are counted, not restored; a batch ``as_of`` a
snapshot carries its labels; diffs, the CLI, retention, the archive and the web view; a
restore brings the archived snapshots back over the new ids. (A recipe ``as_of`` a
snapshot, served by a prefetch worker: tests/stack/test_served_versions.py.)"""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
from typer.testing import CliRunner

from claw_tasks.format.stepmeta import UNTRAINABLE
from claw_tasks.store import Store
from claw_tasks.store.labels import Labels
from claw_tasks.store.layout import NUM_TAG_DTYPE, nan_xor
from claw_tasks.store.retention import Retention
from claw_tasks.store.snapshot_format import SnapshotError
from orchestrator.cli.main import app
from orchestrator.delivery.client import BatchClient
from orchestrator.maintenance import snapshots as versions
from orchestrator.maintenance.archive import archive_namespace
from orchestrator.maintenance.restore import restore
from orchestrator.sampling.sample import sample
from orchestrator.web.views import Inspector
from tests.support.stepdata import batch

MUTABLE = ("flags", "quality", "priority", "t:level")


def _fill(url: str, ns: str, episodes: int = 40, length: int = 50) -> tuple[Store, np.ndarray]:
    store = Store(url, ns)
    store.create(capacity=4000, n_shards=2)
    steps = [
        {
            "ep": e,
            "step": i,
            "reward": float(i % 7),
            "task_id": ("a", "b")[e % 2],
            "tags": {"level": str(e % 3)},
        }
        for e in range(episodes)
        for i in range(length)
    ]
    return store, store.commit(batch(steps)).ids


def _raw(store: Store) -> dict[str, np.ndarray]:
    """The mutable columns as stored, every shard, plus ids and alive bits."""
    cfg = store.config(refresh=True)
    parts = [store.meta_columns(s, ["id", *MUTABLE]) for s in range(cfg.n_shards)]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out["priority"] = out["priority"].view(np.uint32)  # bits, NaN (unset) included
    return out


def _label(store: Store, ids: np.ndarray, rng: np.random.Generator) -> None:
    """10 % untrainable, priorities, a quality and a tag on others."""
    pick = rng.permutation(ids)
    tenth = len(ids) // 10
    store.curate(pick[:tenth], trainable=False)
    store.curate(pick[tenth : 2 * tenth], quality=f"q{rng.integers(100)}", tags={"level": "9"})
    some = pick[: len(ids) // 2]
    store.update_priorities(some, rng.random(len(some)).astype(np.float32) + 0.01)


def test_rollback_puts_labels_priorities_recipes_back_bit_for_bit(redis_url, namespace):
    store, ids = _fill(redis_url, namespace)
    rng = np.random.default_rng(7)
    _label(store, ids, rng)
    client = BatchClient(namespace, redis_url)
    try:
        client.register(
            {
                "name": "r",
                "batch_size": 8,
                "fields": ["obs"],
                "sources": [{"name": "s", "where": "reward > $lo"}],
                "params": {"lo": 1.0},
            }
        )
        store.r.hset(client.registry.augment_stats("r"), mapping={"digest": b"d1", "op": b"\x01"})
        info = versions.take(store, "before")
        assert info.steps == len(ids) and info.extra["recipes"]["r"]["params"] == {"lo": 1.0}
        want = _raw(store)
        # ... then everything changes again, a tenth of the steps is evicted and more arrive
        store.curate(ids, trainable=True)
        _label(store, ids, np.random.default_rng(8))
        store.update_priorities(ids[:100], np.full(100, 5.0, np.float32))
        client.set_params("r", lo=3.0)
        store.r.hset(client.registry.augment_stats("r"), "op", b"\x02")
        client.register(
            {"name": "late", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "s"}]}
        )
        gone = ids[::10]
        assert store.evict(gone) == len(gone)
        new = store.commit(batch([{"ep": 1000, "step": i} for i in range(30)])).ids
        d = versions.diff_states(store, "before", "now")
        assert (d.added, d.evicted, d.kept) == (30, len(gone), len(ids) - len(gone))
        assert d.priority > 0 and d.untrainable + d.trainable > 0

        report = versions.rollback(store, "before", client)
        assert report.labels.evicted == len(gone) and report.labels.added == 30
        got = _raw(store)
        same = want["alive"] & got["alive"] & (want["id"] == got["id"])
        assert same.sum() == len(ids) - len(gone)
        for col in MUTABLE:  # flags: the trainable bit (eviction set others: next_obs copies)
            g, w = (
                (got[col], want[col])
                if col != "flags"
                else (got[col] & UNTRAINABLE, want[col] & UNTRAINABLE)
            )
            assert np.array_equal(g[same], w[same]), col
        assert set(got["id"][got["alive"]]) >= set(new.tolist())  # committed since: kept
        recipe = client.registry.get("r").recipe
        assert recipe.params == {"lo": 1.0} and recipe.version == report.restored["r"]
        assert store.r.hget(client.registry.augment_stats("r"), "op") == b"\x01"
        assert "late" in report.bumped  # registered since: kept, new version
        after = versions.diff_states(store, "before", "now")
        assert (after.untrainable, after.trainable, after.quality, after.priority) == (0, 0, 0, 0)
        assert after.tags == {"t:level": 0}
        # --drop-new: the steps committed since go too
        again = versions.rollback(store, "before", client, drop_new=True)
        assert again.labels.dropped == 30 and not again.labels.changed.get("priority")
        assert not set(_raw(store)["id"][_raw(store)["alive"]]) & set(new.tolist())
    finally:
        client.close()


def test_as_of_batches_carry_the_snapshots_labels(redis_url, namespace):
    store, ids = _fill(redis_url, namespace)
    _label(store, ids, np.random.default_rng(5))
    versions.take(store, "then")
    then = store.get(ids, fields=[])  # the metadata as it stood at the snapshot
    at = {int(i): k for k, i in enumerate(then["id"])}
    store.curate(ids, trainable=True)  # ... then every label and priority changes
    _label(store, ids, np.random.default_rng(6))
    store.update_priorities(ids, np.full(len(ids), 7.0, np.float32))
    recipe = {
        "name": "old",
        "batch_size": 256,
        "fields": ["reward", "quality", "tags.level", "priority", "trainable"],
        "sources": [{"name": "s", "sampler": {"kind": "uniform"}}],
        "as_of": "then",
    }
    seen = 0
    for k in range(4):
        b = sample(store, recipe, rng=np.random.default_rng(k))
        rows = [at[int(i)] for i in b.ids]
        assert b.meta["quality"] == [then["quality"][r] for r in rows]
        assert b.meta["tags.level"] == [then["tags.level"][r] for r in rows]
        assert np.array_equal(b["priority"], then["priority"][rows], equal_nan=True)
        assert b["trainable"].all() and then["trainable"][rows].all()  # drawn as then
        seen += len(rows)
    assert seen == 1024 and not np.isin(7.0, then["priority"])  # today's would show


def test_snapshot_cli_diff_retention_archive_and_web(redis_url, namespace, tmp_path):
    store, ids = _fill(redis_url, namespace, episodes=10, length=20)
    runner = CliRunner()

    def claw(*args: str) -> str:
        res = runner.invoke(app, ["--redis-url", redis_url, *args])
        assert res.exit_code == 0, res.output
        return res.output

    claw("snapshot", namespace, "s1")
    store.curate(ids[:20], trainable=False)
    claw("snapshot", namespace, "s2")
    d = json.loads(claw("diff", namespace, "s1", "s2", "--json"))
    assert d["untrainable"] == 20 and d["added"] == d["evicted"] == 0
    for task, labelled in (("a", 20), ("b", 0)):  # ids[:20]: episode 0, of task a
        where = f"task_id == '{task}'"
        part = json.loads(claw("diff", namespace, "s1", "s2", "--where", where, "--json"))
        assert (part["untrainable"], part["kept"]) == (labelled, 100)
    listed = json.loads(claw("snapshots", namespace, "--json"))
    assert [s["name"] for s in listed] == ["s1", "s2"]
    res = runner.invoke(app, ["--redis-url", redis_url, "snapshot", namespace, "s1"])
    assert res.exit_code == 1 and "exists" in res.output
    res = runner.invoke(app, ["--redis-url", redis_url, "rollback", namespace, "--to", "nope"])
    assert res.exit_code == 1 and "s1, s2" in res.output  # names the snapshots there are
    out = json.loads(claw("rollback", namespace, "--to", "s1", "--json"))
    assert out["changed"]["trainable"] == 20

    result = archive_namespace(store, tmp_path)  # the nightly archive keeps each snapshot
    assert sorted(p.split("/")[0] for p in result.snapshots) == ["_snapshots"] * 2
    doc = msgpack.unpackb((tmp_path / f"ns={namespace}" / result.snapshots[1]).read_bytes())
    assert doc["name"] == "s2" and doc["header"]["steps"] == len(ids)
    assert archive_namespace(store, tmp_path).snapshots == []  # immutable: written once

    inspector = Inspector(redis_url, redis_url)
    rows = inspector.snapshots(namespace)  # headers only: no comparison read
    assert [(r["name"], r["steps"], r["labels"]) for r in rows] == [
        ("s1", len(ids), None),
        ("s2", len(ids), None),
    ]
    compared = {
        n: next(r["labels"] for r in inspector.snapshots(namespace, n) if r["name"] == n)
        for n in ("s1", "s2")
    }
    assert compared == {"s1": 0, "s2": 20}

    store.set_retention(Retention(max_snapshots=2))
    claw("snapshot", namespace, "s3")
    assert [s.name for s in store.snapshots()] == ["s2", "s3"]
    claw("snapshot", namespace, "s3", "--delete")
    with pytest.raises(SnapshotError):
        store.labels("s3")


def _state(labels: Labels, key: np.ndarray | None = None) -> dict[int, tuple]:
    """Each live step's labels as comparable values (strings for codes, priority bits), by
    ``key`` (default: its id)."""
    alive = np.flatnonzero(labels.alive)
    names = np.asarray(labels.ids if key is None else key)[alive].tolist()
    quality = labels.strings.get("quality", {})
    level = labels.strings.get("t:level", {})
    rows = zip(
        labels.untrainable[alive].tolist(),
        labels.quality[alive].tolist(),
        labels.priority[alive].tolist(),
        labels.tags["t:level"][alive].tolist(),
        strict=True,
    )
    return {
        int(k): (u, quality.get(q), p, level.get(t))
        for k, (u, q, p, t) in zip(names, rows, strict=True)
    }


def test_restore_brings_the_archives_snapshots_back(redis_url, namespace, tmp_path):
    store, ids = _fill(redis_url, namespace)
    _label(store, ids, np.random.default_rng(1))
    s1 = versions.take(store, "s1")
    want = {"s1": _state(store.labels())}
    store.curate(ids, trainable=True)
    _label(store, ids, np.random.default_rng(2))
    versions.take(store, "s2")
    want["s2"] = _state(store.labels())
    gone = ids[::10]  # evicted before the archive: the snapshots' steps that cannot return
    store.evict(gone)
    kept = np.setdiff1d(ids, gone)
    _label(store, kept, np.random.default_rng(3))  # today's labels: others again
    archive_namespace(store, tmp_path)

    again = Store(redis_url, f"{namespace}-back")
    result = restore(tmp_path, again, capacity=3000, n_shards=3)  # every row moves
    assert [(s.name, s.steps, s.missing, s.skipped) for s in result.snapshots] == [
        ("s1", len(kept), len(gone), None),
        ("s2", len(kept), len(gone), None),
    ]
    listed = again.snapshots()
    assert [s.name for s in listed] == ["s1", "s2"] and listed[0].created == s1.created
    assert listed[0].extra == s1.extra
    for name in ("s2", "s1", "s2"):  # back and forth, each bit for bit
        again.rollback(name)
        now = again.labels()
        orig = np.nan_to_num(nan_xor(now.tags["t:orig_id"].view(NUM_TAG_DTYPE))).astype(np.int64)
        got = _state(now, orig)  # by the id the step had when archived
        assert sorted(got) == sorted(kept.tolist())  # the rollback kept orig_id
        assert got == {k: want[name][k] for k in got}, name
        assert _state(again.labels(name), orig) == got  # the snapshot as restored
    d = versions.diff_states(again, "s1", "s2")
    assert (d.kept, d.added, d.evicted) == (len(kept), 0, 0) and d.priority > 0
    res = CliRunner().invoke(
        app, ["--redis-url", redis_url, "restore", str(tmp_path), "-n", again.namespace, "--json"]
    )  # run again: its steps replay, its snapshots are there already
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{") :])
    assert [s["skipped"] is not None for s in doc["snapshots"]] == [True, True]


def test_a_snapshot_name_with_a_final_newline_is_refused(redis_url, namespace):
    """The attack: ``claw snapshot NS $'x\\n'`` passes a ``^...$`` check (``$`` matches
    before a final newline) and would store a snapshot named ``x\\n``. It is a one-line
    error, nothing stored."""
    store, _ = _fill(redis_url, namespace, episodes=2, length=5)
    for name in ("x\n", "x\r\n", "\nx"):
        res = CliRunner().invoke(app, ["--redis-url", redis_url, "snapshot", namespace, name])
        assert res.exit_code == 1, res.output
        assert "snapshot name" in res.output and "Traceback" not in res.output
        with pytest.raises(SnapshotError, match="snapshot name"):
            store.snapshot(name)
    assert store.snapshots() == []


def _sent_bytes(r) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def test_listing_snapshots_reads_headers_whatever_their_size(redis_url, namespace):
    """A listing that compares each snapshot with now reads every snapshot whole: its
    cost grows with snapshots x capacity (0.7-0.9 s a GET for 20 snapshots of a 1M
    namespace). Listing reads the headers: the bytes Redis sends for it do not grow with
    the snapshots' size (measured in bytes the server sent, not time)."""
    inspector = Inspector(redis_url, redis_url)
    sent = {}
    stored = {}
    for label, cap in (("small", 2_000), ("large", 200_000)):
        ns = f"{namespace}-{label}"
        store = Store(redis_url, ns)
        store.create(capacity=cap, n_shards=2)
        n = cap // 2
        ids = store.commit(
            batch([{"ep": i // 100, "step": i % 100, "reward": 1.0} for i in range(n)])
        ).ids
        rng = np.random.default_rng(0)
        for k in range(4):
            store.update_priorities(ids, rng.random(n).astype(np.float32) + 0.01)
            store.snapshot(f"v{k}")
        stored[label] = sum(s.bytes for s in store.snapshots())
        inspector.snapshots(ns)  # connections and config cached, as a page after the first
        before = _sent_bytes(store.r)
        rows = inspector.snapshots(ns)
        sent[label] = _sent_bytes(store.r) - before
        assert [r["name"] for r in rows] == ["v0", "v1", "v2", "v3"]
    assert stored["large"] > 50 * stored["small"]  # the snapshots grew with capacity
    assert sent["large"] < 2 * sent["small"] + 4096, (sent, stored)  # the listing did not
    assert sent["large"] < stored["large"] / 50, (sent, stored)

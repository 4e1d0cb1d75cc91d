"""Archival to Parquet and restore: lossless both ways, incremental, crash-safe."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from claw_tasks.client import Ingestor
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import FieldSpec
from claw_tasks.store import Store
from orchestrator.cli.main import app
from orchestrator.maintenance.archive import ArchiveBusy, archive_namespace
from orchestrator.maintenance.archive_files import MANIFEST, Manifest
from orchestrator.maintenance.lifecycle import drop_namespace
from orchestrator.maintenance.restore import restore
from tests.support.producer import sender


def claw(redis_url: str, *args: str) -> str:
    result = CliRunner().invoke(
        app, list(args), env={"CLAW_REDIS_URL": redis_url, "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    return result.output


def wait_until(cond, what: str | Callable[[], str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.02)


def _record(redis_url: str, namespace: str, episodes: int = 12) -> None:
    """Steps with a vector obs, an 84x84x3 image, ragged tokens, tags, info, explicit
    final next_obs, priorities and every string column, through the ingest workers."""
    rng = np.random.default_rng(7)
    ing = Ingestor(namespace, redis_url, n_shards=2, flush_interval=None, ragged=("tokens",))
    for e in range(episodes):
        length = 5 + e % 7
        ep = ing.episode(
            f"ep{e}",
            task_id=f"task{e % 3}",
            agent_id="arm" if e % 2 else None,
            reward_source="env",
            policy_version=e,
            color=["red", "blue"][e % 2],
        )
        for t in range(length):
            last = t == length - 1
            tokens = rng.integers(0, 50_000, rng.integers(0, 6)).astype(np.int32)
            extra = {"temp": float(rng.random())} if t % 2 else {}
            ep.add(
                rng.standard_normal(5).astype(np.float32),
                np.int64(t % 4),
                float(rng.standard_normal()),
                next_obs=rng.standard_normal(5).astype(np.float32) if last else None,
                terminated=last and e % 3 != 0,
                truncated=last and e % 3 == 0,
                info={"lives": t, "label": f"x{t}"} if t % 3 == 0 else None,
                skill_tag="reach" if t < 2 else None,
                priority=float(rng.random()) if e % 4 == 0 else None,
                image=rng.integers(0, 256, (84, 84, 3), dtype=np.uint8),
                tokens=tokens,
                **extra,
            )
    assert ing.close().committed == sum(5 + e % 7 for e in range(episodes))
    store = Store(redis_url, namespace)
    store.curate(episode_id="ep1", quality="golden")
    store.curate(episode_id="ep2", quality="bad", trainable=False)


def _steps(store: Store) -> dict[tuple[str, int], dict]:
    """Every live step by (episode id, step index), as ``Store.get`` reads it."""
    out = {}
    for shard in range(store.config().n_shards):
        cols = store.meta_columns(shard, ["id"])
        ids = cols["id"][cols["alive"]]
        if not len(ids):
            continue
        got = store.get(ids)
        for i in range(len(ids)):
            row = {k: v[i] for k, v in got.items()}
            out[(row["episode_id"], int(row["step_index"]))] = row
    return out


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray | np.generic) or isinstance(b, np.ndarray | np.generic):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return a == b


def _table_by_step(ns_dir: Path) -> pa.Table:
    manifest = Manifest.load(ns_dir)
    assert manifest is not None
    tables = [pq.read_table(ns_dir / f["path"]) for f in manifest.files]
    table = pa.concat_tables(tables, promote_options="permissive")
    keys = pa.table({"e": table["episode_id"].cast(pa.string()), "s": table["step_index"]})
    return table.take(pc.sort_indices(keys, [("e", "ascending"), ("s", "ascending")]))


def _check_archive(ns_dir: Path, store: Store) -> list[int]:
    """The manifest matches the files (names, rows, checksums, id ranges), and the files
    hold each live step exactly once; returns the archived ids."""
    manifest = Manifest.load(ns_dir)
    assert manifest is not None
    on_disk = {p.relative_to(ns_dir).as_posix() for p in ns_dir.rglob("*") if p.is_file()}
    assert on_disk == {f["path"] for f in manifest.files} | {MANIFEST}
    ids = []
    for f in manifest.files:
        data = (ns_dir / f["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"]
        got = pq.read_table(pa.BufferReader(data), columns=["id"]).column("id").to_numpy()
        assert len(got) == f["rows"]
        assert (got.min(), got.max()) == (f["id_min"], f["id_max"])
        ids += got.tolist()
    assert len(ids) == len(set(ids)), "a step is in the archive twice"
    live = []
    cfg = store.config()
    for shard in range(cfg.n_shards):
        cols = store.meta_columns(shard, ["id"])
        live += cols["id"][cols["alive"]].tolist()
        seq = int(store.r.get(store.layout_keys.shard_key(shard, "seq")))
        assert manifest.watermarks[shard] == seq
        assert int(store.r.get(store.layout_keys.archived(shard))) == seq
    assert sorted(ids) == sorted(live), "archive and store hold different steps"
    assert manifest.rows == len(ids)
    return ids


@pytest.mark.both_stores
def test_archive_restore_every_field_label_and_tag(redis_url, namespace, tmp_path, ingest_worker):
    _record(redis_url, namespace)
    src = Store(redis_url, namespace)
    out = claw(redis_url, "archive", namespace, "--to", str(tmp_path / "arch"))
    assert "steps" in out
    ns_dir = tmp_path / "arch" / f"ns={namespace}"
    ids = _check_archive(ns_dir, src)
    # Partitioned by date; the first file holds the schema's dtype and shape.
    files = sorted(ns_dir.rglob("*.parquet"))
    assert all(p.parent.name.startswith("date=") and p.name.startswith("part-") for p in files)
    image = pq.read_schema(files[0]).field("image")
    assert json.loads(image.metadata[b"claw"]) == {"dtype": "|u1", "shape": [84, 84, 3]}

    # A second run finds nothing new and writes nothing.
    before = {p: p.stat().st_mtime_ns for p in ns_dir.rglob("*")}
    again = json.loads(
        claw(redis_url, "archive", namespace, "--to", str(tmp_path / "arch"), "--json").split(
            "\n", 1
        )[1]
    )
    assert again["files"] == [] and again["rows"] == 0
    assert {p: p.stat().st_mtime_ns for p in ns_dir.rglob("*")} == before

    # Restore into a new namespace: every value equal, new ids, the old ones in orig_id.
    dst_ns = namespace + "-back"
    claw(redis_url, "restore", str(tmp_path / "arch"), "--namespace", dst_ns)
    dst = Store(redis_url, dst_ns)
    a, b = _steps(src), _steps(dst)
    assert a.keys() == b.keys() and len(a) == len(ids)
    for key, row in a.items():
        back = b[key]
        assert back["tags.orig_id"] == row["id"]
        for col, value in row.items():
            if col != "id":
                assert _same(value, back[col]), (key, col, value, back[col])
    assert {r["quality"] for r in b.values()} == {None, "golden", "bad"}
    assert not all(r["trainable"] for r in b.values())
    assert dst.config().schema.fields["image"] == FieldSpec("|u1", (84, 84, 3))

    # The restored namespace archives to the same tables (info included), but for ids.
    claw(redis_url, "archive", dst_ns, "--to", str(tmp_path / "arch2"))
    t1 = _table_by_step(ns_dir)
    t2 = _table_by_step(tmp_path / "arch2" / f"ns={dst_ns}")
    assert t1.num_rows == t2.num_rows
    for name in t1.column_names:
        if name != "id":
            # repr: floats exactly, and NaN equal to NaN
            assert repr(t1.column(name).to_pylist()) == repr(t2.column(name).to_pylist()), name
    assert t2.column("tags.orig_id").to_pylist() == t1.column("id").to_pylist()

    # The archive reads as a plain Parquet dataset (the query of docs/architecture.md).
    steps = ds.dataset(tmp_path / "arch" / f"ns={namespace}", partitioning="hive")
    returns = (
        steps.to_table(
            columns=["episode_id", "reward"],
            filter=(ds.field("date") >= "2026-11-01") & (ds.field("task_id") == "task0"),
        )
        .group_by("episode_id")
        .aggregate([("reward", "sum")])
    )
    want = {}
    for (episode, _), row in a.items():
        if row["task_id"] == "task0":
            want[episode] = want.get(episode, 0.0) + float(row["reward"])
    got = dict(zip(*returns.to_pydict().values(), strict=True))
    assert got.keys() == want.keys()
    assert all(abs(got[e] - want[e]) < 1e-9 for e in want)


def test_archive_after_sigkill_has_every_step_once(redis_url, namespace, tmp_path, start_worker, r):
    n = 10_000
    app = sender(redis_url)

    def send(store: Store, root: Path) -> None:
        # Small files: many runs, so the kill lands in the middle of the archive.
        app.send_task(
            "claw.maintenance.archive",
            args=[store.namespace, str(root)],
            kwargs={"chunk_bytes": 8192},
            queue="maintenance",
        )

    def archived(store: Store) -> int:
        return sum(int(v or 0) for v in r.mget(store.layout_keys.archived(s) for s in range(2)))

    worker = start_worker("maintenance", CLAW_ARCHIVE_LOCK_TTL="2")
    # The kill must land mid-archive. Writes are held (reads go on) from the check until
    # the worker is dead, so it cannot finish between the two; but this process may be
    # descheduled for as long as the whole archive takes (seconds) before its check: a
    # run found finished proves nothing and is done again on a new namespace.
    for attempt in range(3):
        store = _steps_in_two_shards(redis_url, f"{namespace}-{attempt}", n)
        root = tmp_path / str(attempt)
        send(store, root)
        wait_until(lambda store=store: archived(store) > 0, "the archive to start")
        r.client_pause(60_000, all=False)
        try:
            done = archived(store)
            if done < n:
                worker.kill()
                break
            assert done == n  # a run found finished still archived every step once
        finally:
            r.client_unpause()
    else:
        pytest.fail("the archive finished before the kill three times: the test proves nothing")
    lock = store.owned_key("archive-lock")
    wait_until(lambda: not r.exists(lock), "the dead run's lock to lapse")

    # The default TTL (60 s) for the re-run: at 2 s its own lock lapsed between two
    # files' extends on a loaded machine, and the run stopped ("the run stalled").
    start_worker("maintenance")
    send(store, root)
    wait_until(
        lambda: archived(store) == n and not r.exists(lock),
        lambda: f"the re-run: {archived(store)} of {n} archived, lock {r.get(lock)!r}",
    )
    ids = _check_archive(root / f"ns={store.namespace}", store)
    assert len(ids) == n
    # Episodes span many files: restored file by file, their next_obs links come back.
    back = Store(redis_url, namespace + "-back")
    assert restore(root, back).rows == n
    for e in range(0, n // 50, 20):
        a, b = store.episode(f"ep{e}"), back.episode(f"ep{e}")
        for col in ("obs", "next_obs", "has_next_obs", "action", "step_index"):
            assert _same(a[col], b[col]), (e, col)


def _steps_in_two_shards(redis_url: str, namespace: str, n: int) -> Store:
    """A namespace of 2 shards holding ``n`` steps of 50-step episodes."""
    store = Store(redis_url, namespace)
    store.create(100_000, n_shards=2)
    rng = np.random.default_rng(1)
    store.commit(
        StepBatch(
            episode=StrColumn.of([f"ep{i // 50}" for i in range(n)]),
            step_index=np.arange(n) % 50,
            reward=rng.standard_normal(n).astype(np.float32),
            terminated=np.arange(n) % 50 == 49,
            truncated=np.zeros(n, bool),
            fields={
                "obs": rng.standard_normal((n, 4)).astype(np.float32),
                "action": np.arange(n, dtype=np.int64),
            },
        )
    )
    return store


def _one_step() -> StepBatch:
    return StepBatch(
        episode=StrColumn.constant("e", 1),
        step_index=np.zeros(1, np.int64),
        reward=np.zeros(1, np.float32),
        terminated=np.zeros(1, bool),
        truncated=np.zeros(1, bool),
        fields={"obs": np.zeros((1, 2), np.float32)},
    )


@pytest.mark.both_stores
def test_archive_across_the_ring_end(redis_url, namespace, tmp_path):
    """Runs split where the ring wraps; steps the ring passed before a run are counted."""
    store = Store(redis_url, namespace)
    store.create(100)

    def commit(k: int) -> None:
        for _ in range(k):
            store.commit(_one_step())

    commit(250)  # seqs 1..250; only 151..250 are still stored
    first = archive_namespace(store, tmp_path, chunk_bytes=64 * 30)
    assert (first.rows, first.overwritten) == (100, 150)
    commit(80)  # seqs 251..330 take slots 50..99, then wrap to 0..29
    second = archive_namespace(store, tmp_path, chunk_bytes=64 * 30)
    assert (second.rows, second.overwritten) == (80, 0)
    ns_dir = tmp_path / f"ns={namespace}"
    ids = [i for f in sorted(ns_dir.rglob("*.parquet")) for i in pq.read_table(f)["id"].to_pylist()]
    assert sorted(ids) == list(range(151, 331))
    assert Manifest.load(ns_dir).watermarks == {0: 330}


def test_archive_waits_for_slots_allocated_but_not_committed(redis_url, namespace, tmp_path):
    """A batch allocated before others and committed after them holds the watermark back
    (its steps must not be skipped), unless abandoned longer than the grace period."""
    store = Store(redis_url, namespace)
    store.create(1000)
    store.commit(_one_step())  # seq 1
    late = _one_step()
    late.batch_id = "late"
    assert store.allocate(0, "late", 1) == (2, "new")  # seq 2: allocated, not committed
    store.commit(_one_step())  # seq 3
    first = archive_namespace(store, tmp_path)
    assert (first.rows, first.blocked, first.watermarks) == (1, {0: 2}, {0: 1})
    store.commit(late)  # lands in its slot, seq 2
    second = archive_namespace(store, tmp_path)
    assert (second.rows, second.blocked, second.watermarks) == (2, {}, {0: 3})
    # Abandoned (grace 0: the later commit is older than that): it no longer blocks.
    assert store.allocate(0, "never", 1) == (4, "new")
    store.commit(_one_step())  # seq 5
    third = archive_namespace(store, tmp_path, grace=0)
    assert (third.rows, third.blocked, third.watermarks) == (1, {}, {0: 5})
    ns_dir = tmp_path / f"ns={namespace}"
    ids = [i for f in sorted(ns_dir.rglob("*.parquet")) for i in pq.read_table(f)["id"].to_pylist()]
    assert sorted(ids) == [1, 2, 3, 5]


def test_archive_refusals_name_the_cause(redis_url, namespace, tmp_path):
    store = Store(redis_url, namespace)
    store.create(100)
    r = store.r
    r.set(store.owned_key("archive-lock"), "someone")
    store.commit(_one_step())
    with pytest.raises(ArchiveBusy, match="another archive run"):
        archive_namespace(store, tmp_path)
    r.delete(store.owned_key("archive-lock"))
    archive_namespace(store, tmp_path / "a")
    # Archiving elsewhere would split the archive: refused, with the way out.
    with pytest.raises(LookupError, match="another directory"):
        archive_namespace(store, tmp_path / "b")
    # Dropped and created again, its seqs start over: not mixed into the old archive.
    drop_namespace(r, namespace)
    again = Store(redis_url, namespace)
    again.create(100)
    again.commit(_one_step())
    with pytest.raises(LookupError, match="dropped and created again"):
        archive_namespace(again, tmp_path / "a")
    result = CliRunner().invoke(
        app, ["restore", str(tmp_path / "nowhere"), "-n", "x"], env={"CLAW_REDIS_URL": redis_url}
    )
    assert result.exit_code == 1 and "no Claw archive" in result.output

    # A damaged file, and a file whose checksum is right but whose steps are not.
    ns_dir = tmp_path / "a" / f"ns={namespace}"
    manifest = Manifest.load(ns_dir)
    path = ns_dir / manifest.files[0]["path"]
    good = path.read_bytes()
    path.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(ValueError, match="does not match the manifest"):
        restore(tmp_path / "a", Store(redis_url, namespace + "-r1"))
    table = pq.read_table(pa.BufferReader(good))
    bad = table.set_column(
        table.column_names.index("reward"), "reward", pa.array([float("nan")], pa.float32())
    )
    pq.write_table(bad, path)
    manifest.files[0]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest.save(ns_dir)
    with pytest.raises(ValueError, match="reward is nan"):
        restore(tmp_path / "a", Store(redis_url, namespace + "-r2"))


def test_a_file_failing_to_settle_lists_nothing_after_it(
    redis_url, namespace, tmp_path, monkeypatch
):
    """Runs are encoded ahead of the one being settled (checksum, fsync, rename, manifest,
    watermark): when one fails, neither it nor a later run is listed, no temp file is
    left, and the next archive run writes the rest once."""
    from orchestrator.maintenance import archive_files

    store = Store(redis_url, namespace)
    store.create(1000)
    for _ in range(40):
        store.commit(_one_step())
    finish = archive_files.PendingFile.finish
    calls = []

    def failing(self):
        calls.append(self.path.name)
        if len(calls) == 3:
            raise OSError("disk full")
        return finish(self)

    monkeypatch.setattr(archive_files.PendingFile, "finish", failing)
    with pytest.raises(OSError, match="disk full"):
        archive_namespace(store, tmp_path, chunk_bytes=72 * 8)  # 64 + 8 B a step: runs of 8
    ns_dir = tmp_path / f"ns={namespace}"
    manifest = Manifest.load(ns_dir)
    assert manifest.watermarks == {0: 16} and manifest.rows == 16
    assert int(store.r.get(store.layout_keys.archived(0))) == 16
    on_disk = {p.relative_to(ns_dir).as_posix() for p in ns_dir.rglob("*") if p.is_file()}
    assert on_disk == {f["path"] for f in manifest.files} | {MANIFEST}
    monkeypatch.setattr(archive_files.PendingFile, "finish", finish)
    again = archive_namespace(store, tmp_path, chunk_bytes=72 * 8)
    assert again.rows == 24
    assert sorted(_check_archive(ns_dir, store)) == list(range(1, 41))

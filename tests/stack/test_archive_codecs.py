"""Archives of compressed fields: the stored frames kept as they are, the codec recorded,
restored bit for bit; exports for other tools (plain Parquet, Minari) decoded.

Steps go in through the real ingest worker, the archive is written by the maintenance
worker's task (and by ``claw archive``), restored and exported by the CLI.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from claw_tasks.broker.app import client_app
from claw_tasks.client import Ingestor
from claw_tasks.codecs import Codec, decode
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from orchestrator.cli.main import app
from orchestrator.maintenance.archive_files import Manifest

EPISODES = 6


def claw(redis_url: str, *args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"CLAW_REDIS_URL": redis_url})
    assert result.exit_code == 0, result.output
    return result.output


def frame_of(e: int, t: int, rng: np.random.Generator) -> np.ndarray:
    """A 24x24x3 game-like frame: a flat background, a moving block, a little noise."""
    img = np.full((24, 24, 3), 30 + e, np.uint8)
    img[t % 20 : t % 20 + 4, 5:9] = (200, 80, 10)
    img[rng.integers(0, 24), rng.integers(0, 24)] = rng.integers(0, 256, 3)
    return img


def record(redis_url: str, namespace: str, codec: str) -> Store:
    """Episodes with a compressed obs (explicit final next_obs), a compressed ragged field
    and a raw one, through the ingest worker (the producer encodes)."""
    schema = Schema(
        fields={
            "obs": FieldSpec("|u1", (24, 24, 3), codec=codec),
            "action": FieldSpec("<i8", ()),
            "tokens": FieldSpec("<i4", (None,), codec="zstd"),
        }
    )
    rng = np.random.default_rng(3)
    ing = Ingestor(namespace, redis_url, n_shards=2, flush_interval=None, schema=schema)
    n = 0
    for e in range(EPISODES):
        length = 7 + 3 * e
        with ing.episode(f"ep{e}", task_id="game") as ep:
            for t in range(length):
                last = t == length - 1
                ep.add(
                    frame_of(e, t, rng),
                    np.int64(t % 4),
                    float(t),
                    terminated=False,
                    truncated=last,
                    next_obs=frame_of(e, t + 1, rng) if last else None,
                    tokens=rng.integers(0, 1000, t % 5).astype(np.int32),
                )
                n += 1
    assert ing.close().committed == n
    return Store(redis_url, namespace)


def live(store: Store) -> dict[tuple[str, int], dict]:
    """Every live step by (episode id, step index), decoded (``Store.get``), with its
    stored obs frame and explicit next_obs frame."""
    out = {}
    cfg = store.config()
    for shard in range(cfg.n_shards):
        cols = store.meta_columns(shard, ["id"])
        ids = cols["id"][cols["alive"]]
        got = store.get(ids)
        shards, slots = store.locate(ids)
        frames = store.read_frames(shards, slots, "obs")
        nx = store.read_frames(shards, slots, "obs", explicit=True)
        for i in range(len(ids)):
            row = {k: v[i] for k, v in got.items()}
            row["frame"], row["nx_frame"] = frames[i], nx[i]
            out[(row["episode_id"], int(row["step_index"]))] = row
    return out


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def archive_by_worker(redis_url: str, namespace: str, root: Path, store: Store, log: Path) -> None:
    """The maintenance worker's archive task, as beat sends it; waits for the watermark
    (a task that raised fails the test with the worker's error)."""
    client_app(redis_url).send_task(
        "claw.maintenance.archive", args=[namespace, str(root)], queue="maintenance"
    )
    keys = [store.layout_keys.archived(s) for s in range(2)]
    last = {s: int(store.r.get(store.layout_keys.shard_key(s, "seq")) or 0) for s in range(2)}
    deadline = time.monotonic() + 60
    while [int(v or 0) for v in store.r.mget(keys)] != [last[0], last[1]]:
        failed = [line for line in log.read_text().splitlines() if "raised unexpected" in line]
        assert not failed, failed[0]
        assert time.monotonic() < deadline, "the archive task did not finish"
        time.sleep(0.05)
    while store.r.exists(store.owned_key("archive-lock")):
        assert time.monotonic() < deadline, "the archive task kept its lock"
        time.sleep(0.05)


@pytest.mark.parametrize("codec", ["png", "delta:4"])
def test_frames_archived_as_stored_and_restored_bit_exact(
    redis_url, namespace, tmp_path, ingest_worker, start_worker, codec
):
    src = record(redis_url, namespace, codec)
    before = live(src)
    worker = start_worker("maintenance")
    root = tmp_path / "arch"
    archive_by_worker(redis_url, namespace, root, src, worker.log)
    ns_dir = root / f"ns={namespace}"
    manifest = Manifest.load(ns_dir)
    assert manifest is not None and manifest.rows == len(before)
    assert manifest.schema["fields"]["obs"]["codec"] == codec  # the codec is recorded
    files = [pq.read_table(ns_dir / f["path"]) for f in manifest.files]
    table = pa.concat_tables(files)
    obs = table.schema.field("obs")
    assert json.loads(obs.metadata[b"claw"]) == {
        "dtype": "|u1",
        "shape": [24, 24, 3],
        "codec": codec,
    }
    by_id = {v["id"]: v for v in before.values()}
    ids = table.column("id").to_pylist()
    if codec == "png":  # the column holds the store's frames, byte for byte
        assert pa.types.is_large_binary(obs.type)
        assert table.column("obs").to_pylist() == [by_id[i]["frame"] for i in ids]
        nx = table.column("next_obs").to_pylist()
        assert nx == [by_id[i]["nx_frame"] for i in ids]
        assert sum(f is not None for f in nx) == EPISODES
    else:  # delta frames name other steps' ids: the rows are archived decoded
        rows = np.stack([np.frombuffer(b, np.uint8) for b in table.column("obs").to_pylist()])
        want = np.stack([by_id[i]["obs"].reshape(-1) for i in ids])
        assert same(rows, want)
    tokens = table.schema.field("tokens")
    assert json.loads(tokens.metadata[b"claw"])["codec"] == "zstd"

    claw(redis_url, "restore", str(root), "--namespace", namespace + "-back")
    dst = Store(redis_url, namespace + "-back")
    assert dst.config().schema.fields["obs"].codec == Codec.of(codec)
    after = live(dst)
    assert after.keys() == before.keys()
    for key, row in before.items():
        back = after[key]
        assert back["tags.orig_id"] == row["id"]
        for col in ("obs", "next_obs", "has_next_obs", "action", "tokens", "reward", "truncated"):
            assert same(row[col], back[col]), (key, col)
        if codec == "png":  # restored as they were archived: the same bytes in Redis
            assert back["frame"] == row["frame"] and back["nx_frame"] == row["nx_frame"]


def test_exports_decode(redis_url, namespace, tmp_path, ingest_worker):
    src = record(redis_url, namespace, "zstd")
    before = live(src)
    root, plain = tmp_path / "arch", tmp_path / "plain"
    claw(redis_url, "archive", namespace, "--to", str(root))
    out = claw(
        redis_url,
        "export",
        namespace,
        "--format",
        "parquet",
        "--archive",
        str(root),
        "--to",
        str(plain),
    )
    assert str(plain / f"ns={namespace}") in out.replace("\n", "")

    # A plain Parquet dataset: fixed-size binary pixels, no codec anywhere.
    steps = ds.dataset(plain / f"ns={namespace}", partitioning="hive").to_table()
    obs = steps.schema.field("obs")
    assert obs.type == pa.binary(24 * 24 * 3)
    assert json.loads(obs.metadata[b"claw"]) == {"dtype": "|u1", "shape": [24, 24, 3]}
    assert "codec" not in json.dumps(json.loads(steps.schema.metadata[b"claw"])["schema"])
    tokens = steps.column("tokens").to_pylist()
    for i, step_id in enumerate(steps.column("id").to_pylist()):
        row = next(v for v in before.values() if v["id"] == step_id)
        assert (
            np.frombuffer(steps.column("obs")[i].as_py(), np.uint8).tobytes()
            == row["obs"].tobytes()
        )
        assert tokens[i] == row["tokens"].tolist()
        nx = steps.column("next_obs")[i].as_py()
        assert (nx is None) == (row["nx_frame"] is None)
        if nx is not None:
            assert bytes(np.array(nx, np.uint8)) == row["next_obs"].tobytes()
    # ...and it restores too, into a namespace of raw fields.
    claw(redis_url, "restore", str(plain), "--namespace", namespace + "-plain")
    assert Store(redis_url, namespace + "-plain").config().schema.fields["obs"].codec is None

    # Minari: complete episodes, decoded observations.
    import minari

    minari_root = tmp_path / "minari"
    claw(
        redis_url, "export", namespace, "--to", "claw/codecs-v0", "--minari-root", str(minari_root)
    )

    os.environ["MINARI_DATASETS_PATH"] = str(minari_root)
    try:
        data = minari.load_dataset("claw/codecs-v0")
        assert data.total_episodes == EPISODES
        for ep in data.iterate_episodes():
            name = next(iter(data.storage.get_episode_metadata([ep.id])))["claw_episode_id"]
            length = len(ep.actions)
            want = [before[(name, t)]["obs"] for t in range(length)]
            want.append(before[(name, length - 1)]["next_obs"])
            assert same(np.asarray(ep.observations), np.stack(want))
    finally:
        del os.environ["MINARI_DATASETS_PATH"]


def test_frames_decode_with_the_recorded_codec(redis_url, namespace, tmp_path, ingest_worker):
    """Another tool reads an archived frame with the codec in the column metadata."""
    src = record(redis_url, namespace, "zstd")
    claw(redis_url, "archive", namespace, "--to", str(tmp_path))
    ns_dir = tmp_path / f"ns={namespace}"
    path = ns_dir / Manifest.load(ns_dir).files[0]["path"]
    table = pq.read_table(path)
    meta = json.loads(table.schema.field("obs").metadata[b"claw"])
    rows = decode(
        Codec.of(meta["codec"]),
        table.column("obs").to_pylist(),
        np.dtype(meta["dtype"]),
        tuple(meta["shape"]),
    )
    got = src.get(table.column("id").to_pylist(), ["obs"])["obs"]
    assert same(rows, got)

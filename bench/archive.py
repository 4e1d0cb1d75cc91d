"""Archive to Parquet and restore: steps/s and MB/s, vector and image steps.

    .venv/bin/python bench/archive.py [--vector-steps 1000000] [--image-steps 50000]
                                      [--dir /tmp]

Starts a private redis-server, fills a namespace through ``Store.commit`` (not timed),
then times ``claw archive``'s work (``Archiver.run``: range reads, Parquet, SHA-256,
fsync, manifest, watermark) and ``claw restore``'s (checksum, Parquet read,
``Store.commit`` with the archived timestamps, labels) into a new namespace. MB/s counts
the steps' payload bytes (fields + 64 bytes of metadata per step), not the file bytes.
Beside wall time it reports the CPU seconds of this process and of redis-server (a
figure that does not move with the machine's load) and the 1-minute load average. The
peer, measured in the same run: the same number of bytes, in files of the archive's
sizes, written to the same directory with ``os.write`` and fsynced each (what the disk
takes, the ceiling for archival).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from orchestrator.maintenance.archive import Archiver
from orchestrator.maintenance.archive_files import Manifest, drop_cached
from orchestrator.maintenance.restore import restore

META_BYTES = 64
BATCH = 1 << 14


def fill(store: Store, n: int, obs_shape: tuple[int, ...], obs_dtype: str) -> int:
    """``n`` steps in 1000-step episodes; returns the payload bytes per step."""
    rng = np.random.default_rng(0)
    store.create(n + 10)
    batch_rows = max(1, min(BATCH, (64 << 20) // (int(np.prod(obs_shape)) or 1)))
    for start in range(0, n, batch_rows):
        k = min(batch_rows, n - start)
        idx = np.arange(start, start + k)
        if np.dtype(obs_dtype).kind == "u":
            obs = rng.integers(0, 256, (k, *obs_shape), dtype=np.uint8)
        else:
            obs = rng.standard_normal((k, *obs_shape)).astype(obs_dtype)
        ended = idx % 1000 == 999
        store.commit(
            StepBatch(
                episode=StrColumn.of([f"ep{i // 1000}" for i in idx]),
                step_index=idx % 1000,
                reward=rng.standard_normal(k).astype(np.float32),
                terminated=ended,
                truncated=np.zeros(k, bool),
                fields={"obs": obs, "action": rng.integers(0, 4, k)},
                strs={"task_id": StrColumn.constant("bench", k)},
                next_rows=np.flatnonzero(ended).astype(np.int32),
                next_obs=obs[ended],
            )
        )
    return int(np.prod(obs_shape)) * np.dtype(obs_dtype).itemsize + 8 + META_BYTES


class Clock:
    """Wall time, and CPU time of this process (all threads) plus the Redis server's: on
    a shared machine the CPU figure does not depend on what else runs."""

    def __init__(self, store: Store) -> None:
        self.r = store.r

    def _redis_cpu(self) -> float:
        info = self.r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def __enter__(self) -> Clock:
        self.wall, self.cpu, self.rcpu = time.perf_counter(), time.process_time(), self._redis_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu + self._redis_cpu() - self.rcpu


def disk_ceiling(root: Path, sizes: list[int]) -> tuple[float, float]:
    """Wall and CPU seconds to write files of ``sizes`` bytes (random, so the disk cannot
    dedupe or compress them) into ``root``, each fsynced and dropped from the page cache
    as archival does."""
    data = np.random.default_rng(1).integers(0, 256, max(sizes), dtype=np.uint8).data
    wall, cpu = time.perf_counter(), time.process_time()
    for i, size in enumerate(sizes):
        fd = os.open(root / f"ceiling-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < size:
                done += os.write(fd, data[done:size])
            os.fsync(fd)
            drop_cached(fd)
        finally:
            os.close(fd)
    out = time.perf_counter() - wall, time.process_time() - cpu
    for i in range(len(sizes)):
        os.unlink(root / f"ceiling-{i}")
    return out


def run(url: str, label: str, n: int, shape: tuple[int, ...], dtype: str, root: Path) -> None:
    ns = label.split()[0]
    src = Store(url, f"bench-{ns}")
    row = fill(src, n, shape, dtype)
    with Clock(src) as arch:
        res = Archiver(src, root).run()
    assert res.rows == n, res
    dst = Store(url, f"bench-{ns}-restored")
    with Clock(src) as rest:
        back = restore(root, dst)
    assert back.rows == n, back
    mb = n * row / 1e6
    size = f"{n:,} steps, {len(res.files)} files, {res.bytes / 1e6:,.0f} MB"
    load = f"{os.getloadavg()[0]:.1f}"
    for what, c in (("archive", arch), ("restore", rest)):
        print(
            f"| {label} {what} | {n / c.wall:,.0f} | {mb / c.wall:,.0f} | {c.wall:.2f} s | "
            f"{c.cpu:.2f} s | {mb / c.cpu:,.0f} | {size} | {load} |"
        )
    manifest = Manifest.load(next(root.glob("ns=*")))
    assert manifest is not None
    wall, cpu = disk_ceiling(root, [f["bytes"] for f in manifest.files])
    fmb = res.bytes / 1e6
    print(
        f"| peer: os.write + fsync of the same file sizes | | {fmb / wall:,.0f} | {wall:.2f} s | "
        f"{cpu:.2f} s | {fmb / cpu:,.0f} | {size} | {load} |"
    )
    src.r.flushall()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vector-steps", type=int, default=1_000_000)
    ap.add_argument("--image-steps", type=int, default=50_000)
    ap.add_argument("--dir", default=None, help="Where the archive goes (default: a temp dir)")
    args = ap.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("| figure | steps/s | MB/s | wall | CPU (client + Redis) | MB per CPU-s | size | load |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    with RedisServer() as server:
        for label, n, shape, dtype in (
            ("vector float32[8]", args.vector_steps, (8,), "<f4"),
            ("image uint8[84,84,3]", args.image_steps, (84, 84, 3), "|u1"),
        ):
            if n:
                root = Path(tempfile.mkdtemp(dir=args.dir, prefix="claw-archive-"))
                try:
                    run(server.url, label, n, shape, dtype, root)
                finally:
                    shutil.rmtree(root)


if __name__ == "__main__":
    main()

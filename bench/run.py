"""Run the benches behind docs/benchmarks.md's "Performance goals" table, one after the
other, and keep what each printed beside the machine's load.

    .venv/bin/python bench/run.py [--only NAME ...] [--out DIR] [--list]

Each bench starts its own private redis-server and workers. The figures stay in each
bench's own output (`DIR/<name>.txt`); `DIR/summary.md` lists every bench with its
command, exit status, wall time and the 1-minute load average before and after it, which
is what a figure on the benchmarks page must be read against. Run it on a quiet machine:
the figures move with the load (docs/benchmarks.md says by how much).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Bench:
    name: str
    goals: str  # the rows of the goals table this bench's output holds
    args: tuple[str, ...]  # the script under bench/, then its arguments
    env: tuple[tuple[str, str], ...] = ()


BENCHES = (
    Bench(
        "sb3_dqn",
        "SB3 DQN wall / SB3's buffer (no kwargs, gradient_steps=128); BatchClient.pop p50",
        ("sb3_dqn.py", "--steps", "50000", "--rounds", "2", "--variants", "sb3,defaults,gs128"),
        (("OMP_NUM_THREADS", "1"),),
    ),
    Bench("adds", "trainer-side cost of an add", ("adds.py", "--steps", "20000", "--rounds", "1")),
    Bench(
        "sample_store",
        "whole batch 256 x float32[8] @1M (static store); PER draw against cpprb",
        ("sample_store.py", "--sizes", "1000000", "--repeats", "300", "--images", "20000"),
    ),
    Bench(
        "changing_batch",
        "whole batch 256 x float32[8] @1M (changing store)",
        ("changing_batch.py", "--repeats", "300"),
    ),
    Bench("priorities", "update_priorities(256) @1M", ("priorities.py", "--repeats", "300")),
    Bench("ingest", "vector and image ingest; Redis bytes per vector step", ("ingest.py",)),
    Bench("prefetch", "fill loop, augmented images/s per core", ("prefetch.py",)),
    Bench(
        "atari",
        "Atari bytes per frame against zstd-3; fill loop with png frames (bench extra)",
        ("atari.py", "--parts", "codecs,store,prefetch", "--batches", "30"),
    ),
    Bench("maintenance", "eviction: longest Redis call", ("maintenance.py", "--steps", "1000000")),
    Bench("archive", "archive and restore MB/s", ("archive.py",)),
)


def command(bench: Bench) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / bench.args[0]), *bench.args[1:]]


def shown_args(bench: Bench) -> list[str]:
    return [f"bench/{bench.args[0]}", *bench.args[1:]]


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def run(bench: Bench, out: Path) -> str:
    """Run one bench, its output to `out/<name>.txt`; its summary row."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **dict(bench.env)}
    before, start = load(), time.monotonic()
    with (out / f"{bench.name}.txt").open("w") as log:
        rc = subprocess.run(command(bench), cwd=ROOT, env=env, stdout=log, stderr=log).returncode
    wall = time.monotonic() - start
    shown = " ".join([*(f"{k}={v}" for k, v in bench.env), ".venv/bin/python", *shown_args(bench)])
    status = "ok" if rc == 0 else f"exit {rc}"
    return (
        f"| {bench.name} | {bench.goals} | `{shown}` | {status} | {wall:.0f} s | "
        f"{before} / {load()} | [{bench.name}.txt]({bench.name}.txt) |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [b.name for b in BENCHES]
    parser.add_argument("--only", nargs="+", choices=names, help="these benches alone")
    parser.add_argument("--out", type=Path, help="default: tmp/bench-<UTC time>")
    parser.add_argument("--list", action="store_true", help="print the benches and exit")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    if args.list:
        for b in chosen:
            print(f"{b.name:15} {' '.join(shown_args(b))}")
        return 0
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "tmp" / f"bench-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    rows = ["| bench | goals | command | status | wall | load before / after | output |"]
    rows.append("|---|---|---|---|---:|---|---|")
    failed = 0
    for bench in chosen:
        print(f"== {bench.name} (load {load()})", flush=True)
        row = run(bench, out)
        failed += "| ok |" not in row
        rows.append(row)
        (out / "summary.md").write_text(
            f"# Bench run {stamp}\n\nCommit: {_commit()}; {os.cpu_count()} cores.\n\n"
            + "\n".join(rows)
            + "\n"
        )
    print(f"== summary: {out / 'summary.md'}")
    return 1 if failed else 0


def _commit() -> str:
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return proc.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())

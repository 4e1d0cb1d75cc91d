"""One bench, two trees, in turns: this checkout against another (an older commit from
``git archive``), so that a ratio compares code under the same minutes of the machine's
load. Each round runs the bench once in each tree (the order alternates between rounds),
with that tree first on ``PYTHONPATH`` and as the working directory, so the bench, its
workers and the code they import are the tree's own.

    git archive <rev> | tar -x -C /tmp/base
    .venv/bin/python bench/versus.py --base /tmp/base --rounds 2 -- \
        bench/changing_batch.py --repeats 300

Prints each run's output under a heading naming the tree and round; the figures are read
from there (benches print markdown).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run(tree: Path, bench: list[str]) -> tuple[int, float]:
    """Run ``bench`` (a script path relative to a tree, then its arguments) in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    rc = subprocess.call([sys.executable, str(tree / bench[0]), *bench[1:]], cwd=tree, env=env)
    return rc, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other tree (a directory)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("name the bench after --, e.g. -- bench/changing_batch.py")
    base = args.base.resolve()
    if not (base / bench[0]).is_file():
        ap.error(f"--base: {base / bench[0]} does not exist")
    trees = {"this": HERE, "base": base}
    for i in range(args.rounds):
        order = ["base", "this"] if i % 2 == 0 else ["this", "base"]
        for name in order:
            print(f"\n### {name} tree, round {i + 1}: {trees[name]}\n", flush=True)
            rc, wall = run(trees[name], bench)
            print(f"\n(exit {rc}, {wall:.1f} s wall, load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()

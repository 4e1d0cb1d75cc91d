"""A process of its own using a namespace's shared sampling index (test_shared_index.py).

``python tests/indexproc.py URL NAMESPACE MODE [N]``:

- ``pause``: sync as the writer and stop itself (SIGSTOP) half-way through writing the
  re-read columns of new rows, so the test can SIGKILL a writer mid-write;
- ``check``: N times: sync, check that every live row is whole (its ``reward`` encodes its
  ``step_index``: ``stepdata.episode``), release; prints the rows found torn (JSON);
- ``sample``: N batches of a seeded uniform recipe; prints their ids (JSON).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

import orchestrator.sampling.index as index
from claw_tasks.store import Store
from orchestrator.sampling.sample import sample
from orchestrator.sampling.shared import SharedIndex

RECIPE = {
    "name": "uni",
    "batch_size": 16,
    "fields": ["obs", "reward"],
    "sources": [{"name": "all", "where": {}}],
    "seed": 3,
}


def torn_rows(ix: SharedIndex) -> list[int]:
    cols = ix.columns
    rows = np.flatnonzero(cols["alive"])
    frac = np.round((cols["reward"][rows] % 1) * 100).astype(np.int64)
    return rows[frac != cols["step_index"][rows]].tolist()


def main() -> None:
    url, namespace, mode = sys.argv[1:4]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    store = Store(url, namespace)
    if mode == "pause":
        ix = SharedIndex(store)
        real, calls = index.decode_meta, []

        def decode_then_stop(*args):  # the third column of the new rows: half written
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(*args)

        index.decode_meta = decode_then_stop
        ix.sync()
        print("not stopped", flush=True)
    elif mode == "check":
        ix, torn = SharedIndex(store), []
        for _ in range(n):
            ix.sync()
            torn += torn_rows(ix)
            ix.release()
        print(json.dumps(torn), flush=True)
    elif mode == "sample":
        ids = [sample(namespace, RECIPE, redis_url=url).ids.tolist() for _ in range(n)]
        print(json.dumps(ids), flush=True)


if __name__ == "__main__":
    main()

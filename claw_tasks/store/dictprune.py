"""Dictionary pruning: strings no live step uses any more leave the namespace's
dictionaries, so high-cardinality strings (trajectory ids, prompts as tags) do not grow
them forever. The caller (the eviction pass) says which codes live steps use.

Two phases (``lua/dictprune.lua``): an unused entry is first *marked* (out of the forward
map; an encode of the string revives it with the same code), and *swept* on a later pass
at least ``GRACE_S`` after, if still unused: longer than any encode-to-commit gap of a
live ingest task, so no committed step ever holds a code without a name. A swept code is
never reused (codes only grow); readers that cached it hear of it through a ``forget``
event in every shard's change log (the sampling index hands it to its string caches).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from claw_tasks.store.config import LOG_MAXLEN
from claw_tasks.store.core import StoreCore
from claw_tasks.store.scripts import Lua

GRACE_S = 300.0
BATCH = 500
"""Entries per script call and per HSCAN page."""
_SCRIPT = Lua("dictprune")


def prune_column(store: StoreCore, col: str, used: Collection[int], now: float) -> int:
    """One pruning step of string column ``col``, whose codes in ``used`` live steps
    hold: revive marked entries in use, mark unused ones, sweep those marked ``GRACE_S``
    ago (announced as a ``forget`` event). Returns the entries swept."""
    k = store.layout_keys
    keys = [k.dict(col), k.rdict(col), k.dpend(col)]
    sweep, revive, marked = [], [], set()
    for s, v in store.r.hscan_iter(keys[2], count=BATCH):
        code_text, _, at = v.partition(b":")
        code = int(code_text)
        marked.add(code)
        if code in used:
            revive += [s, code_text]
        elif now - float(at or 0) >= GRACE_S:
            sweep += [s, code_text]
    mark = []
    for code_text, s in store.r.hscan_iter(keys[1], count=BATCH):
        code = int(code_text)
        if code and code not in used and code not in marked:
            mark += [s, code_text]
    _run(store, keys, "revive", revive, now)
    _run(store, keys, "mark", mark, now)
    if _run(store, keys, "sweep", sweep, now):
        _announce(store, col, [int(c) for c in sweep[1::2]])
    return len(sweep) // 2


def _run(store: StoreCore, keys: list[str], mode: str, pairs: list, now: float) -> int:
    done = 0
    for i in range(0, len(pairs), 2 * BATCH):
        done += int(_SCRIPT(store.r, keys, [mode, repr(now), *pairs[i : i + 2 * BATCH]]))
    return done


def _announce(store: StoreCore, col: str, codes: list[int]) -> None:
    """A ``forget`` event in every shard's log: cached codes of ``col`` are stale."""
    packed = np.asarray(codes, "<i4").tobytes()
    with store.r.pipeline(transaction=False) as pipe:
        for shard in range(store.config().n_shards):
            pipe.xadd(
                store.layout_keys.shard_key(shard, "log"),
                {"op": "forget", "col": col, "codes": packed},
                maxlen=LOG_MAXLEN,
                approximate=True,
            )
        pipe.execute()

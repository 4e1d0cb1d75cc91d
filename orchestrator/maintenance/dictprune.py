"""Dictionary pruning (part of each eviction pass): the string codes the live steps of the
sampling index hold, handed to the store's pruning (``claw_tasks.store.dictprune``, which
says how a string is marked, then swept, without a committed step losing its name)."""

from __future__ import annotations

import numpy as np

from claw_tasks.format.schema import tag_column
from claw_tasks.format.stepmeta import DICT_COLUMNS
from claw_tasks.store import Store
from claw_tasks.store.dictprune import prune_column
from orchestrator.sampling.index import SamplingIndex


def prune_dictionaries(store: Store, index: SamplingIndex, now: float) -> dict[str, int]:
    """One pruning step over every string column; returns entries swept per column."""
    tags = index.schema.tags if index.schema else {}
    columns = [*DICT_COLUMNS, *(tag_column(t) for t, kind in tags.items() if kind == "str")]
    alive = index.columns["alive"]
    return {
        col: prune_column(store, col, set(np.unique(index.columns[col][alive]).tolist()), now)
        for col in columns
    }

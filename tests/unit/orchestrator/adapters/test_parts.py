"""A batch as parts: each keeps its sources' mix, and the batch in part order cuts into the
same parts by contiguous rows."""

from __future__ import annotations

import numpy as np

from orchestrator.adapters.parts import split
from orchestrator.delivery.wire import Batch
from orchestrator.sampling.batch import part_order


def test_split_parts_keep_each_sources_share_and_every_row_once():
    n = 32
    batch = Batch(
        {"x": np.arange(n) * 10},
        np.arange(n),
        np.ones(n, np.float32),
        np.repeat([0, 1], [24, 8]).astype(np.int16),
        ("a", "b"),
        1,
        {"task_id": [f"t{i}" for i in range(n)]},
    )
    parts = split(batch, 4)
    assert [len(p) for p in parts] == [8] * 4
    for p in parts:
        assert np.bincount(p.source_index).tolist() == [6, 2]  # the batch's 3:1 mix
        assert (p["x"] == p.ids * 10).all()
        assert p.meta["task_id"] == [f"t{i}" for i in p.ids]
    assert sorted(np.concatenate([p.ids for p in parts]).tolist()) == list(range(n))


def test_part_order_puts_each_split_part_in_contiguous_rows() -> None:
    n, parts = 24, 4
    batch = Batch(
        {"obs": np.arange(n * 3).reshape(n, 3), "reward": np.arange(n) * 0.5},
        np.arange(100, 100 + n),
        np.ones(n, np.float32),
        np.zeros(n, np.int16),
        ("all",),
        7,
    )
    whole, m = batch.take(part_order(n, parts)), n // parts
    cut = split(whole, parts, contiguous=True)
    for j, part in enumerate(split(batch, parts)):
        np.testing.assert_array_equal(cut[j].ids, part.ids)
        rows = slice(j * m, (j + 1) * m)
        np.testing.assert_array_equal(whole.ids[rows], part.ids)
        for name in ("obs", "reward"):
            np.testing.assert_array_equal(whole[name][rows], part[name])
    assert whole.recipe_version == 7

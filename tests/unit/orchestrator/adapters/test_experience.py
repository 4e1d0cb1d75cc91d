"""Adapter plumbing (adapters.experience): splitting a batch by source, sizing reads from
the trainer's bursts, and URLs saved without their password."""

from __future__ import annotations

import numpy as np

from orchestrator.adapters.cadence import Cadence, Plan, plan_for
from orchestrator.adapters.experience import (
    interleaved,
    split,
    with_env_password,
    without_password,
)
from orchestrator.delivery.wire import Batch


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


def test_saved_urls_carry_no_password():
    url = "redis://user:s3cret@host:6380/2"
    saved = without_password(url)
    assert "s3cret" not in saved and saved == "redis://user@host:6380/2"
    assert without_password("redis://:s3cret@host/0") == "redis://host/0"
    assert with_env_password(saved, url) == url  # same server: the environment's password
    assert with_env_password(saved, "redis://user:x@other:6380/2") == saved


def test_cadence_plans_for_the_longest_recent_burst():
    cadence = Cadence()
    assert cadence.auto and cadence.plan == plan_for(1) == Plan(1, 2, 8)
    changed = [cadence.sampled() for _ in range(128)]
    assert cadence.plan == plan_for(128) == Plan(8, 16, 32)  # the hand-tuned sizes
    assert [i + 1 for i, p in enumerate(changed) if p is not None] == [3, 5, 9, 17, 33, 65]
    assert cadence.added() is None and cadence.added() is None  # adds alone change nothing
    for _ in range(7):  # shorter bursts: kept while the long one is among the last 8
        cadence.sampled()
        assert cadence.added() is None
    cadence.sampled()
    assert cadence.added() == plan_for(1)
    for _ in range(100):  # a 100-call burst plans for 128
        cadence.sampled()
    assert cadence.added() is None and cadence.plan == plan_for(128)
    fixed = Cadence(128)
    assert not fixed.auto and fixed.plan == Plan(8, 16, 32)
    assert all(fixed.sampled() is None for _ in range(300)) and fixed.added() is None
    assert Cadence(None, 1, 0).plan == Plan(1, 0, 8)  # given sizes win
    assert plan_for(10_000) == plan_for(256) == Plan(16, 16, 32)  # bounded queues


def test_interleaved_puts_each_split_part_in_contiguous_rows() -> None:
    n, parts = 24, 4
    batch = Batch(
        {"obs": np.arange(n * 3).reshape(n, 3), "reward": np.arange(n) * 0.5},
        np.arange(100, 100 + n),
        np.ones(n, np.float32),
        np.zeros(n, np.int16),
        ("all",),
        7,
    )
    whole, m = interleaved(batch, parts), n // parts
    for j, part in enumerate(split(batch, parts)):
        rows = slice(j * m, (j + 1) * m)
        np.testing.assert_array_equal(whole.ids[rows], part.ids)
        for name in ("obs", "reward"):
            np.testing.assert_array_equal(whole[name][rows], part[name])
    assert whole.recipe_version == 7

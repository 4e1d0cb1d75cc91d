"""Served staleness as counters: a batch's rows' versions against the recipe's current
version, summed into a recipe's counters and read back as batches / mean / max."""

from __future__ import annotations

import numpy as np

from orchestrator.delivery.admission import served_staleness, staleness_counts
from orchestrator.recipe.model import Recipe


def test_served_staleness_counters_round_trip():
    r = Recipe.model_validate(
        {
            "name": "r",
            "batch_size": 4,
            "fields": ["obs"],
            "params": {"policy_version": 10},
            "admission": {"max_staleness": 3},
            "sources": [{"name": "a"}],
        }
    )
    counts: dict[str, float] = {}
    for versions in ([10, 10, 9, 9], [7, 8, 10, 10], [10, 10, 10, 10]):
        for k, v in staleness_counts(r, np.array(versions)).items():
            counts[k] = counts.get(k, 0) + v
    got = served_staleness(counts)
    assert got == {"batches": 3, "mean": round((0.5 + 1.25 + 0.0) / 3, 6), "max": 3}
    counts["stale:max:3"] = 0  # taken back (a batch pushed, then refused): not a maximum
    assert served_staleness(counts)["max"] == 1
    assert served_staleness({}) is None
    plain = r.model_copy(update={"admission": None})
    assert staleness_counts(plain, np.array([1, 2])) == {}

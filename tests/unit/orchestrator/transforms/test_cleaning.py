"""The cleaning spec on its own: the mapping to the target representation (renames, feature
order and units, one-hot to discrete and back, dtypes) and the rules naming each bad step
(NaNs, out-of-range values, z-score and IQR outliers), and the digests dedup compares.
tests/stack/test_cleaning.py runs the same source through real workers."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.transforms.cleaning import (
    CleanSpec,
    Outliers,
    map_fields,
    step_digests,
    violations,
)
from orchestrator.transforms.quantiles import SAMPLE_ROWS, QuantileSample
from orchestrator.transforms.running import RunningStats
from tests.support.cleansource import NAN_ROWS, OUTLIER_ROWS, RANGE_ROWS, SPEC, N, raw_source


def test_rules_name_each_bad_step_and_the_mapping_reaches_the_target_representation():
    state, act = raw_source()
    spec = CleanSpec.model_validate({**SPEC, "namespace": "raw"})
    fields = map_fields(spec, {"state": state, "act": act})
    assert fields["obs"].dtype == np.float32 and fields["obs"].shape == (N, 4)
    assert fields["action"].dtype == np.int64 and set(np.unique(fields["action"])) <= {0, 1}
    stats = {"obs": RunningStats.of(np.nan_to_num(fields["obs"]))}
    found = violations(spec, fields, stats)
    assert np.flatnonzero(found["finite"]).tolist() == NAN_ROWS
    assert np.flatnonzero(found["range"]).tolist() == RANGE_ROWS
    assert set(OUTLIER_ROWS) <= set(np.flatnonzero(found["outlier:obs"]).tolist())
    one_hot = map_fields(
        CleanSpec.model_validate({"namespace": "x", "fields": {"a": {"one_hot": 3}}}),
        {"a": np.array([0, 2, 7])},
    )["a"]
    assert one_hot[:2].tolist() == [[1, 0, 0], [0, 0, 1]] and np.isnan(one_hot[2]).all()


def test_iqr_fences_over_a_merged_sample_flag_far_values_and_skip_features_without_spread():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (6000, 3))
    x[:, 2] = (rng.random(6000) < 0.1).astype(float)  # a one-hot-like feature: IQR 0
    keys = rng.random(6000)
    merged = QuantileSample()
    for lo in (4000, 0, 2000):  # any order of batches gives the same sample
        merged.merge(QuantileSample.of(x[lo : lo + 2000], keys[lo : lo + 2000]))
    other = QuantileSample()
    for lo in (0, 2000, 4000):
        other.merge(QuantileSample.of(x[lo : lo + 2000], keys[lo : lo + 2000]))
    assert merged.count == 6000 and len(merged.rows) == SAMPLE_ROWS
    assert np.array_equal(merged.rows, other.rows)
    q1, q3 = merged.quartiles()
    assert np.allclose(q1[:2], -0.674, atol=0.08) and np.allclose(q3[:2], 0.674, atol=0.08)
    probe = np.array([[0.1, 0.2, 1.0], [5.0, 0.0, 0.0], [0.0, -5.5, 0.0], [2.5, 0.0, 1.0]])
    assert merged.outside(probe, 3.0).tolist() == [False, True, True, False]
    spec = CleanSpec.model_validate(
        {"namespace": "x", "outliers": [{"field": "obs", "iqr": 3, "min_count": 100}]}
    )
    found = violations(spec, {"obs": probe}, {}, {"obs": merged})
    assert found["iqr:obs"].tolist() == [False, True, True, False]
    too_few = violations(spec, {"obs": probe}, {}, {"obs": QuantileSample.of(x[:50], keys[:50])})
    assert not too_few["iqr:obs"].any()  # fewer than min_count steps: nothing judged yet


def test_an_outlier_entry_is_a_z_score_by_default_and_never_both():
    assert Outliers().z == 6 and Outliers().rule == "outlier:obs"
    assert Outliers(iqr=1.5).z is None and Outliers(iqr=1.5).rule == "iqr:obs"
    with pytest.raises(ValueError, match="z or iqr"):
        Outliers(z=3, iqr=1.5)


def test_equal_steps_have_equal_digests_and_any_difference_changes_them():
    obs = np.arange(12, dtype=np.float32).reshape(4, 3)
    obs[3] = obs[0]
    action = np.array([1, 0, 1, 1])
    reward = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    done = np.zeros(4, bool)
    d = step_digests({"obs": obs, "action": action}, ["obs", "action"], reward, done)
    assert d[0] == d[3] and len(set(d)) == 3 and len(d[0]) == 8
    reward[3] = 0.5
    assert step_digests({"obs": obs, "action": action}, ["obs", "action"], reward, done)[3] != d[0]
    only_obs = step_digests({"obs": obs, "action": np.arange(4)}, ["obs"], np.ones(4), done)
    assert only_obs[0] == only_obs[3]  # the fields compared are the ones named

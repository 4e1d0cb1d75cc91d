"""The cleaning spec on its own: the mapping to the target representation (renames, feature
order and units, one-hot to discrete and back, dtypes) and the rules naming each bad step
(NaNs, out-of-range values, z-score outliers). tests/stack/test_cleaning.py runs the same
source through real workers."""

from __future__ import annotations

import numpy as np

from orchestrator.transforms.cleaning import CleanSpec, map_fields, violations
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

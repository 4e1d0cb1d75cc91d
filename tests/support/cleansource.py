"""A noisy source for the cleaning tests (tests/unit/orchestrator/transforms/test_cleaning.py,
tests/stack/test_cleaning.py): its raw steps and the spec that cleans them."""

from __future__ import annotations

import numpy as np

N = 1500  # raw steps: more than one cleaning batch (1024), so outliers meet statistics
NAN_ROWS, RANGE_ROWS, OUTLIER_ROWS = [3, 700], [10, 1200], [1100, 1300, 1400]
SPEC = {
    "namespace": "",  # set per test
    "rename": {"state": "obs", "act": "action"},
    "fields": {
        "obs": {"take": [3, 2, 1, 0], "scale": 0.1, "dtype": "float32"},  # mm -> cm, reversed
        "action": {"argmax": True, "dtype": "int64"},  # one-hot -> discrete
    },
    "rules": [
        {"name": "finite", "field": "obs", "finite": True},
        {"name": "range", "field": "obs", "range": [-5, 5]},
    ],
    "outliers": [{"field": "obs", "z": 8, "min_count": 500}],
    "tags": {"origin": "noisy"},
}


def raw_source(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """The noisy source's own representation: float64 ``state`` in tenths, reversed;
    ``act`` one-hot."""
    rng = np.random.default_rng(0)
    obs = rng.normal(0, 0.5, (n, 4))
    obs[NAN_ROWS, 1] = np.nan
    obs[RANGE_ROWS, 0] = 40.0  # out of [-5, 5]
    obs[OUTLIER_ROWS, 2] = 4.9  # in range, ~10 standard deviations out
    action = rng.integers(0, 2, n)
    return obs[:, ::-1] * 10.0, np.eye(2, dtype=np.float32)[action]

"""``rollouts.select`` over columns holding rollout tags that are finite in float64 but
not in float32 (stored by a path that did not check them): such a step counts as missing its
tag, so it is never taken, and a step whose successor's value overflows float32 is not
ready (its bootstrap would be inf)."""

from __future__ import annotations

import numpy as np

from claw_tasks.format.schema import BOOTSTRAP_VALUE, LOG_PROB, VALUE, tag_column
from claw_tasks.format.stepmeta import TERMINATED
from orchestrator.sampling.rollouts import select


def _columns(values: list[float], terminated: list[bool]) -> dict[str, np.ndarray]:
    """One shard, one episode: step i in row i, each linked to the next."""
    n = len(values)
    nxt = np.ones(n, np.int32)
    nxt[-1] = 0
    return {
        "id": np.arange(1, n + 1, dtype=np.int64),
        "alive": np.ones(n, bool),
        "next": nxt,
        "policy_version": np.zeros(n, np.int32),
        "step_index": np.arange(n, dtype=np.int32),
        "episode": np.ones(n, np.int64),
        "reward": np.ones(n, np.float32),
        "flags": np.where(np.array(terminated), TERMINATED, 0).astype(np.uint8),
        tag_column(VALUE): np.array(values, np.float64),
        tag_column(LOG_PROB): np.full(n, -0.5),
        tag_column(BOOTSTRAP_VALUE): np.full(n, np.nan),
    }


def test_a_value_finite_only_in_float64_is_never_taken() -> None:
    cols = _columns([0.5, 1e300, 0.5, 0.5], [False, False, False, True])
    sel = select(cols, np.ones(4, bool), 4, np.zeros(0, np.int64), 0, 0, steps=2)
    assert sel.taken is not None
    taken = set(sel.taken.ids.tolist())
    assert 2 not in taken  # its value overflows float32
    assert 1 not in taken  # its successor's value (its bootstrap) does
    assert taken == {3, 4}
    assert np.isfinite(sel.taken.value.astype(np.float32)).all()
    assert np.isfinite(sel.taken.next_value.astype(np.float32)).all()
    assert select(cols, np.ones(4, bool), 4, np.zeros(0, np.int64), 0, 0, steps=3).taken is None

"""Read sizes planned from the trainer's bursts."""

from __future__ import annotations

from orchestrator.adapters.cadence import Cadence, Plan, plan_for


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

"""The pop rate limit (delivery.ratelimit): the rule, and the worked example of the docs."""

from __future__ import annotations

from orchestrator.delivery import ratelimit
from orchestrator.recipe.options import RateLimit


def test_rate_limit_rule():
    rl = RateLimit(samples_per_insert=2.0, error_buffer=10, min_size=100)
    assert not ratelimit.check(rl, 99, 0, 1)
    assert ratelimit.check(rl, 100, 0, 10)  # 200 - 10 >= 200 - 10
    assert not ratelimit.check(rl, 100, 0, 11)
    assert ratelimit.check(rl, 150, 100, 10)  # 300 - 110 >= 190
    assert not ratelimit.check(rl, 150, 100, 11)
    assert ratelimit.check(None, 0, 1e9, 1)


def test_rate_limit_worked_example_of_the_docs():
    """docs/recipes.md, "Rate limit": spi 4, error_buffer 100, min_size 1000, 256 rows."""
    rl = RateLimit(samples_per_insert=4.0, error_buffer=100, min_size=1000)
    assert not ratelimit.check(rl, 1000, 0, 256)  # min_size reached, the first batch waits
    for k in range(1, 6):  # the k-th batch needs 975 + 64 k steps
        need, sampled = 975 + 64 * k, 256 * (k - 1)
        assert ratelimit.check(rl, need, sampled, 256)
        assert not ratelimit.check(rl, need - 1, sampled, 256)
    assert ratelimit.check(rl, 1039, 0, 256) and ratelimit.check(rl, 1103, 256, 256)
    assert not ratelimit.check(rl, 1166, 512, 256) and ratelimit.check(rl, 1167, 512, 256)
    assert ratelimit.check(rl, 1_000_000, 256 * 15_608, 256)  # a backlog of 15,609 batches
    assert not ratelimit.check(rl, 1_000_000, 256 * 15_609, 256)

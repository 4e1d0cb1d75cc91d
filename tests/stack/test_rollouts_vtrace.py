"""V-trace in the prefetch workers: a lagged rollout's target numbers come from the
recipe's scorer (allowed by the worker's CLAW_SCORERS); the minibatches equal vtrace() of
the recorded steps and the scorer's numbers."""

from __future__ import annotations

import numpy as np

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import Schema
from orchestrator import BatchClient
from orchestrator.transforms.advantages import vtrace
from tests.support.paths import ROOT
from tests.support.rollout_actors import GAMMA, LAM, Actor, keys_of, recipe


def test_vtrace_with_a_scorer_for_lagged_steps(redis_url, start_worker, namespace):
    """max_lag 1, advantage vtrace: the target numbers come from the recipe's scorer
    (tests.support.scorers.rollout_target: log_prob -0.05 and value 0.1 times the step
    index, next_value 1); the minibatches equal vtrace() of them."""
    scorer = "tests.support.scorers:rollout_target"
    start_worker("ingest,prefetch", CLAW_SCORERS=scorer, PYTHONPATH=str(ROOT))
    records: dict = {}
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    actors = [Actor(ing, k, records, seed=20 + k) for k in range(4)]
    for a in actors:
        a.segment(8, 0)
        a.segment(8, 1)
    ing.flush()
    client = BatchClient(namespace, redis_url)
    client.register(
        recipe(max_lag=1, advantage="vtrace", scorer=scorer, rho_bar=1.2)
        | {"params": {"policy_version": 1}}
    )
    batches = [client.pop("ppo", timeout=60) for _ in range(12)]
    rows = {key: i for b in batches[:4] for i, key in enumerate(keys_of(b))}
    chains = sorted(rows, key=lambda k: (k[0], k[1], k[2]))
    mu = np.array([records[k]["log_prob"] for k in chains])
    pi = -0.05 * np.array([k[2] for k in chains], np.float64)
    value = 0.1 * np.array([k[2] for k in chains], np.float64)
    r = np.array([records[k]["reward"] for k in chains])
    term = np.array([records[k]["terminated"] for k in chains])
    end = np.array(
        [
            i == len(chains) - 1 or chains[i + 1] != (k[0], k[1], k[2] + 1)
            for i, k in enumerate(chains)
        ]
    )
    ref = vtrace(mu, pi, r, value, np.ones(len(chains)), term, end, GAMMA, 1.2, 1.0, LAM)
    want = {k: (a, ret) for k, a, ret in zip(chains, ref.advantages, ref.returns, strict=True)}
    for b in batches:
        keys = keys_of(b)
        np.testing.assert_allclose(
            b["advantages"], [want[k][0] for k in keys], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(b["returns"], [want[k][1] for k in keys], rtol=1e-5, atol=1e-5)
    client.close()
    ing.close()

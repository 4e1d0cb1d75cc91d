"""Errors a newcomer meets name the cause and the fix (real Redis and Celery workers)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import yaml

import orchestrator
from claw_tasks.client import IngestError, Ingestor
from claw_tasks.connection.server import RedisServer
from orchestrator.delivery.client import BatchClient
from orchestrator.recipe.base import RecipeError
from orchestrator.recipe.model import Recipe
from tests.stack.test_cli import fill

VECTOR = {
    "name": "r",
    "batch_size": 4,
    "fields": ["obs", "action", "reward", "next_obs"],
    "sources": [{"name": "all"}],
}


def test_an_augment_op_that_cannot_apply_is_refused_at_register(redis_url, namespace):
    fill(redis_url, namespace)  # obs float32 (4,)
    recipe = {**VECTOR, "augment": {"obs": [{"random_shift": {"pad": 4}}], "next_obs": "same"}}
    with BatchClient(namespace, redis_url) as client:
        with pytest.raises(RecipeError) as e:
            client.register(recipe)
        assert not client.registry.names()  # nothing registered, nothing prefetched
    msg = str(e.value)
    assert "augment.obs: random_shift cannot apply to field 'obs' of shape (4,) (float32)" in msg
    assert "augment.next_obs: random_shift" in msg
    ok = {**VECTOR, "augment": {"obs": [{"gaussian_noise": {"std": 0.1}}], "next_obs": "same"}}
    Recipe.model_validate(ok).validate_against(client.store.schema())


@pytest.fixture(scope="module")
def no_workers_url():
    """A Redis no worker listens on (the session's has workers from other tests)."""
    with RedisServer() as server:
        yield server.url


def test_pop_timeout_without_a_prefetch_worker_says_run_claw_up(no_workers_url, namespace):
    fill(no_workers_url, namespace)
    with BatchClient(namespace, no_workers_url) as client:
        client.register(VECTOR)
        with pytest.raises(TimeoutError, match="no worker consumes `prefetch`: run `claw up`"):
            client.pop("r", timeout=0.5)


def test_pop_timeout_spells_out_the_rate_limit(redis_url, namespace, workers):
    fill(redis_url, namespace)  # 16 steps
    limited = {**VECTOR, "rate_limit": {"samples_per_insert": 2.0, "min_size": 100}}
    with BatchClient(namespace, redis_url) as client:
        client.register(limited)
        with pytest.raises(TimeoutError) as e:
            client.pop("r", timeout=3.0)
    msg = str(e.value)
    assert re.search(r"rate limiter holds prefetch back \(waiting for min_size: \d+ of 100 ", msg)
    assert "min_size x samples_per_insert - error_buffer" in msg and "min_size 100" in msg


def test_pop_timeout_when_data_is_short_says_so(redis_url, namespace, workers):
    fill(redis_url, namespace)
    none = {**VECTOR, "sources": [{"name": "grasp", "where": {"task_id": "nope"}}]}
    with BatchClient(namespace, redis_url) as client:
        client.register(none)
        with pytest.raises(TimeoutError, match=r"insufficient data.*'grasp'"):
            client.pop("r", timeout=3.0)


def test_unconfirmed_ingest_points_to_claw_up(no_workers_url, namespace):
    ingestor = Ingestor(namespace, no_workers_url, flush_interval=None)
    with ingestor.episode() as ep:
        ep.add(obs=np.zeros(3, np.float32), action=np.int64(0), reward=1.0, terminated=True)
    with pytest.raises(IngestError, match=r"Start it with `claw up`"):
        ingestor.close(timeout=0.5)


def test_sample_takes_a_dict_a_yaml_path_or_a_recipe(redis_url, namespace, tmp_path):
    fill(redis_url, namespace)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**VECTOR, "seed": 3}))
    forms = [{**VECTOR, "seed": 3}, path, str(path), Recipe.model_validate({**VECTOR, "seed": 3})]
    got = [
        orchestrator.sample(namespace, f, redis_url=redis_url, rng=np.random.default_rng(0))
        for f in forms
    ]
    for batch in got:
        assert batch["obs"].shape == (4, 4)
        np.testing.assert_array_equal(batch.ids, got[0].ids)


def test_pop_timeout_reports_the_fills_last_error(redis_url, namespace, workers):
    """Registered before any step (nothing to check the shift against), then vector data."""
    recipe = {**VECTOR, "augment": {"obs": [{"random_shift": {"pad": 2}}]}}
    with BatchClient(namespace, redis_url) as client:
        client.register(recipe)
        fill(redis_url, namespace)
        client.request_fill("r", force=True)
        with pytest.raises(TimeoutError) as e:
            client.pop("r", timeout=5.0)
    msg = str(e.value)
    assert (
        "the last fill failed (error: RecipeError: recipe 'r': augment.obs: random_shift "
        "cannot apply to field 'obs' of shape (4,)" in msg
    )
    assert "the worker's log has the traceback" in msg

"""Cleaning a heterogeneous source into a namespace, through real workers: renamed fields,
another feature order and unit, one-hot actions, NaNs, out-of-range values and outliers
go in; batches come out in the target representation, every bad step is quarantined and
counted by rule, and the namespace's normalisation statistics are the same for every
prefetch process and a restarted one."""

from __future__ import annotations

import json
import time

import numpy as np
from typer.testing import CliRunner

from claw_tasks.broker.app import client_app
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.cli.main import app
from orchestrator.delivery.augstats import namespace_stats
from orchestrator.delivery.client import BatchClient
from orchestrator.maintenance.cleaning import define_source, quarantined
from tests.support.cleansource import (
    NAN_ROWS,
    OUTLIER_ROWS,
    RANGE_ROWS,
    SPEC,
    N,
    raw_source,
)


def commit_raw(store: Store, state: np.ndarray, act: np.ndarray) -> None:
    n = len(state)
    store.commit(
        StepBatch(
            episode=StrColumn.of([f"r{i // 100}" for i in range(n)]),
            step_index=np.arange(n) % 100,
            reward=np.ones(n, np.float32),
            terminated=np.zeros(n, bool),
            truncated=np.zeros(n, bool),
            fields={"state": state, "act": act},
        )
    )


def _tick(redis_url: str) -> None:
    client_app(get_settings().broker_for(redis_url)).send_task(
        "claw.maintenance.clean", queue="maintenance"
    )


def test_a_noisy_source_is_cleaned_quarantined_and_normalised_alike(
    redis_url, namespace, start_worker
):
    raw = Store(redis_url, f"{namespace}-raw")
    raw.create(capacity=4000)
    commit_raw(raw, *raw_source())
    target = Store(redis_url, namespace)
    target.create(capacity=4000)
    define_source(target, "noisy", {**SPEC, "namespace": raw.namespace})
    first = start_worker("maintenance,prefetch", concurrency=2)
    deadline = time.monotonic() + 90
    while quarantined(target).get("noisy:steps", 0) < N and time.monotonic() < deadline:
        _tick(redis_url)
        time.sleep(0.5)
    counts = quarantined(target)
    assert counts["noisy:steps"] == N
    assert counts["noisy:finite"] == len(NAN_ROWS) and counts["noisy:range"] == len(RANGE_ROWS)
    assert counts["noisy:outlier:obs"] >= len(OUTLIER_ROWS)
    bad = target.count("not trainable")
    assert bad == target.count("quality == 'quarantine'") >= 7
    assert target.count("tags.origin == 'noisy'") == N  # quarantined, never deleted
    env = {"CLAW_REDIS_URL": redis_url, "COLUMNS": "200"}
    shown = CliRunner().invoke(app, ["stats", "--namespace", namespace, "--json"], env=env)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["namespaces"][0]["cleaning"] == counts  # counts by rule
    text = CliRunner().invoke(app, ["stats", "--namespace", namespace], env=env).output
    assert f"noisy:finite {len(NAN_ROWS)}" in text

    recipe = {
        "name": "clean",
        "batch_size": 64,
        "fields": ["obs", "action"],
        "sources": [{"name": "noisy", "where": "tags.origin == 'noisy'"}],
        "augment": {"obs": [{"running_normalize": {"scope": "namespace"}}]},
        "prefetch": {"depth": 4},
    }
    stats = namespace_stats(target.r, target.keys.base).get("obs")
    assert stats.count == N - bad  # only steps that passed every rule
    client = BatchClient(namespace, redis_url)
    try:
        client.register(recipe)
        batches = [client.pop("clean", timeout=60) for _ in range(6)]
        first.kill()
        start_worker("prefetch")  # a restarted worker: the same statistics from Redis
        client.register({**recipe, "seed": 1})  # a new version: only the new worker's
        batches += [client.pop("clean", timeout=60) for _ in range(3)]
    finally:
        client.close()
    for b in batches:
        assert (b["stats_version.obs"] == stats.count).all()
        assert b["action"].dtype == np.int64 and set(np.unique(b["action"])) <= {0, 1}
        raw_obs = target.get(b.ids, fields=["obs"])["obs"]
        assert np.isfinite(raw_obs).all() and (np.abs(raw_obs) <= 5).all()  # none bad
        want = (raw_obs - stats.mean) / np.sqrt(stats.var + 1e-8)
        assert np.allclose(b["obs"], want, atol=1e-5)

"""Cleaning a heterogeneous source into a namespace, through real workers: renamed fields,
another feature order and unit, one-hot actions, NaNs, out-of-range values and outliers
go in; batches come out in the target representation, every bad step is quarantined and
counted by rule, and the namespace's normalisation statistics are the same for every
prefetch process and a restarted one; repeated steps across sources and IQR outliers are
quarantined too, and a recipe's own ``clean`` section quarantines what it draws."""

from __future__ import annotations

import json
import time

import numpy as np
from typer.testing import CliRunner

from claw_tasks.broker.app import client_app
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.stepmeta import UNTRAINABLE
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.cli.main import app
from orchestrator.delivery.augstats import namespace_stats
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.quarantine import seen_before
from orchestrator.maintenance.cleaning import clean_source, define_source, quarantined, sources
from orchestrator.sampling.index import SamplingIndex
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


def untrainable(store: Store) -> np.ndarray:
    """Ids of the live steps curated ``trainable: false``, sorted."""
    index = SamplingIndex(store)
    index.sync()
    cols = index.columns
    return np.sort(cols["id"][cols["alive"] & ((cols["flags"] & UNTRAINABLE) != 0)])


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
    stats = namespace_stats(target.r, target.layout_keys.base).get("obs")
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


def test_duplicates_across_sources_and_iqr_outliers_are_quarantined_by_rule(redis_url, namespace):
    """One maintenance pass per source (the beat task's body, against the real Redis):
    copies of another source's steps and values far outside the running quartiles are
    quarantined and counted by rule; nothing is deleted."""
    rng = np.random.default_rng(5)
    first = rng.normal(0, 0.5, (600, 4))
    second = rng.normal(0, 0.5, (300, 4))
    second[:100] = first[200:300]  # the same steps (reward and actions equal too)
    second[[150, 160, 170], 1] = 30.0  # in range [-40, 40], ~45 IQRs out
    acts = np.eye(2, dtype=np.float32)[rng.integers(0, 2, 900)]
    acts[600:700] = acts[200:300]
    spec = {
        **SPEC,
        "rules": [{"name": "range", "field": "obs", "range": [-40, 40]}],
        "outliers": [{"field": "obs", "iqr": 3, "min_count": 500}],
        "dedup": {},
    }
    target = Store(redis_url, namespace)
    target.create(capacity=2000)
    for name, state, act in (("a", first, acts[:600]), ("b", second, acts[600:])):
        raw = Store(redis_url, f"{namespace}-{name}")
        raw.create(capacity=1000)
        commit_raw(raw, state[:, ::-1] * 10.0, act)  # the source's own representation
        define_source(target, name, {**spec, "namespace": raw.namespace})
        done = clean_source(target, name, sources(target)[name], budget_s=30)
        assert done["steps"] == len(state)
    counts = quarantined(target)
    assert counts["a:steps"] == 600 and counts["b:steps"] == 300
    assert "a:duplicate" not in counts and counts["b:duplicate"] == 100
    assert counts["b:iqr:obs"] == 3 and "a:iqr:obs" not in counts  # a: too few steps yet
    assert target.count() == 900  # quarantined, never deleted
    assert target.count("not trainable") == target.count("quality == 'quarantine'") == 103
    # One shard: a's steps are ids 1..600, b's 601..900, in their order.
    assert untrainable(target).tolist() == [*range(601, 701), 751, 761, 771]


def test_a_recipes_clean_section_maps_fields_and_quarantines_what_it_draws(
    redis_url, namespace, start_worker
):
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    obs = np.random.default_rng(6).normal(0, 1, (300, 4)).astype(np.float32)
    nan_rows = [7, 99, 201]
    obs[nan_rows, 2] = np.nan
    store.commit(
        StepBatch(
            episode=StrColumn.of([f"e{i // 50}" for i in range(300)]),
            step_index=np.arange(300) % 50,
            reward=np.zeros(300, np.float32),
            terminated=np.zeros(300, bool),
            truncated=np.zeros(300, bool),
            fields={"obs": obs, "action": np.arange(300, dtype=np.int64) % 2},
        )
    )
    start_worker("prefetch")
    client = BatchClient(namespace, redis_url)
    recipe = {
        "name": "cleaned",
        "batch_size": 128,
        "fields": ["obs", "action"],
        "sources": [{"name": "all"}],
        "clean": {
            "fields": {"action": {"one_hot": 2}},
            "rules": [{"name": "finite", "field": "obs", "finite": True}],
        },
        "seed": 0,
        "prefetch": {"depth": 2},
    }
    try:
        client.register(recipe)
        batches = [client.pop("cleaned", timeout=60) for _ in range(6)]
    finally:
        client.close()
    for b in batches:
        assert np.isfinite(b["obs"]).all()  # a batch with a bad row is never served
        assert b["action"].shape == (128, 2) and (b["action"].sum(axis=1) == 1).all()
        assert (b["action"].argmax(axis=1) == (b.ids - 1) % 2).all()  # one shard: id = row + 1
    found = quarantined(store).get("recipe/cleaned:finite", 0)
    bad = untrainable(store)
    assert 1 <= found == len(bad) and set(bad.tolist()) <= {r + 1 for r in nan_rows}


def test_dedup_remembers_the_newest_window_to_twice_the_window_of_digests(redis_url, namespace):
    store = Store(redis_url, namespace)
    d = [bytes([i]) * 8 for i in range(12)]
    assert seen_before(store, [d[0], d[1], d[0]], 4).tolist() == [False, False, True]
    assert seen_before(store, d[2:6], 4).tolist() == [False] * 4  # 4 in: a new generation
    assert seen_before(store, [d[0], d[5]], 4).tolist() == [True, True]  # both still known
    assert seen_before(store, d[6:10], 4).tolist() == [False] * 4  # the first generation goes
    assert seen_before(store, [d[0], d[4], d[9]], 4).tolist() == [False, True, True]

"""A process's namespace contexts hold what the read path builds per namespace (sampling
session, augmentation plans, retrieval sessions, maintenance index): bounded, and forgotten
whole in one call; a namespace made again starts cold; the beat's refill needs no
namespace to reach Redis."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import numpy as np

from claw_tasks.store import Store
from claw_tasks.worker import context
from claw_tasks.worker.lru import LRU
from orchestrator.delivery import prefetch
from orchestrator.delivery.prefetch import run_fill
from orchestrator.delivery.registry import Registry
from orchestrator.maintenance.lifecycle import MAINTENANCE_INDEX, drop_namespace, synced_index
from orchestrator.recipe.model import Recipe
from tests.support.paths import ROOT
from tests.support.stepdata import batch, episode

# The module (``orchestrator.sampling.sample`` the attribute is the function).
sampling = importlib.import_module("orchestrator.sampling.sample")


def _recipe(name: str = "u", **kw) -> Recipe:
    spec = {"name": name, "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
    return Recipe.model_validate({**spec, **kw})


def _namespace(url: str, ns: str) -> Store:
    store = Store(url, ns)
    store.create(capacity=100)
    store.commit(batch(episode(0, 10, "terminated")))
    return store


def _held() -> set[str]:
    return {key[-2] for key in context.contexts}


def test_sampling_sessions_are_bounded_and_forgotten(redis_url, namespace, monkeypatch):
    monkeypatch.setattr(context.contexts, "maxsize", 2)
    names = [f"{namespace}-{i}" for i in range(4)]
    for ns in names:
        _namespace(redis_url, ns)
        sampling.sample(ns, _recipe(), redis_url=redis_url, rng=np.random.default_rng(0))
    assert names[-1] in _held() and names[0] not in _held() and len(context.contexts) <= 2
    ctx = context.context_for(names[-1], redis_url)
    assert ctx.part(sampling.SESSION, dict) is not None
    context.forget(names[-1], dropped=False)
    assert names[-1] not in _held()


def test_prefetch_plans_are_bounded_and_forgotten(redis_url, namespace):
    aug = {"obs": [{"gaussian_noise": {"std": 0.1}}]}
    reg = Registry(_namespace(redis_url, namespace))
    plans = context.context_for(reg.store).part(prefetch.PLANS, lambda: LRU(2))
    for name in ("a", "b", "c"):
        reg.put(_recipe(name, augment=aug), None)
        assert run_fill(reg, name)["made"] > 0
    assert set(plans) == {"b", "c"}
    context.forget(namespace, dropped=False)
    assert namespace not in _held()


def test_one_forget_drops_every_part_and_a_namespace_made_again_starts_cold(redis_url, namespace):
    store = _namespace(redis_url, namespace)
    sampling.sample(store, _recipe(), rng=np.random.default_rng(0))
    reg = Registry(store)
    reg.put(_recipe("aug", augment={"obs": [{"gaussian_noise": {"std": 0.1}}]}), None)
    assert run_fill(reg, "aug")["made"] > 0
    index, _ = synced_index(store)
    ctx = context.context_for(store)
    for name in (sampling.SESSION, prefetch.PLANS, MAINTENANCE_INDEX):
        assert ctx.part(name, lambda: None) is not None, name
    drop_namespace(store.r, namespace)
    assert namespace not in _held()
    _namespace(redis_url, namespace)  # made again: a new config creation time
    again, _ = synced_index(store)
    assert again is not index and again.columns["alive"].sum() == 10
    stale = context.context_for(store)
    stale.created = 0.0  # as if built on an older namespace of the name
    assert synced_index(store)[0] is not again  # rebuilt, with every other part
    assert context.context_for(store) is not stale
    context.forget(namespace, dropped=False)


_REFILL = """
import json
from claw_tasks.worker import context
from orchestrator.maintenance.refill import refill
out = refill()
print(json.dumps({"out": out, "cached": sorted(key[-2] for key in context.contexts)}))
"""


def test_refill_reaches_redis_without_a_made_up_namespace(redis_url, namespace, r):
    reg = Registry(_namespace(redis_url, namespace))
    reg.put(_recipe(), None)
    env = {
        **os.environ,
        "CLAW_REDIS_URL": redis_url,
        "CLAW_BROKER_URL": redis_url,
        "PYTHONPATH": str(ROOT),
        # The shared test Redis holds every other test's namespaces: a cache big enough
        # that this one is not pushed out by them.
        "CLAW_NAMESPACE_CACHE_SIZE": "100000",
    }
    before = r.llen("prefetch")
    run = subprocess.run(
        [sys.executable, "-c", _REFILL],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["out"]["fills"] >= 1 and r.llen("prefetch") > before  # a real fill request
    assert namespace in got["cached"] and "_" not in got["cached"]

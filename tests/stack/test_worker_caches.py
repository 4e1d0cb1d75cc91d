"""Per-process caches of long-lived workers: bounded (LRU), and a namespace's entries can be
dropped (``forget_namespace``); the beat's refill needs no namespace to reach Redis."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import numpy as np

from claw_tasks.store import Store
from orchestrator.delivery import prefetch
from orchestrator.delivery.prefetch import run_fill
from orchestrator.delivery.registry import Registry
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


def test_sampling_sessions_are_bounded_and_forgotten(redis_url, namespace, monkeypatch):
    monkeypatch.setattr(sampling.sessions, "maxsize", 2)
    monkeypatch.setattr(sampling.stores, "maxsize", 2)
    names = [f"{namespace}-{i}" for i in range(4)]
    for ns in names:
        _namespace(redis_url, ns)
        sampling.sample(ns, _recipe(), redis_url=redis_url, rng=np.random.default_rng(0))
    held = {key[-2] for key in sampling.sessions}
    assert names[-1] in held and names[0] not in held and len(sampling.sessions) <= 2
    assert len(sampling.stores) <= 2
    sampling.forget_namespace(names[-1])
    assert names[-1] not in {key[-2] for key in sampling.sessions}
    assert names[-1] not in {key[1] for key in sampling.stores}


def test_prefetch_plans_are_bounded_and_forgotten(redis_url, namespace, monkeypatch):
    monkeypatch.setattr(prefetch.plans, "maxsize", 2)
    aug = {"obs": [{"gaussian_noise": {"std": 0.1}}]}
    reg = Registry(_namespace(redis_url, namespace))
    for name in ("a", "b", "c"):
        reg.put(_recipe(name, augment=aug), None)
        assert run_fill(reg, name)["made"] > 0
    assert set(prefetch.plans) == {(namespace, "b"), (namespace, "c")}
    prefetch.forget_namespace(namespace)
    assert not any(key[0] == namespace for key in prefetch.plans)


_REFILL = """
import json
from claw_tasks.worker import caches
from orchestrator.maintenance.refill import refill
out = refill()
print(json.dumps({"out": out, "cached": sorted(caches.stores)}))
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

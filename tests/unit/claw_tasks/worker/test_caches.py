"""The worker's Store cache (worker.caches): bounded, and a namespace forgotten on demand;
building a Store makes no Redis traffic."""

from __future__ import annotations

from claw_tasks.worker import caches


def test_worker_stores_are_bounded_and_forgotten(monkeypatch):
    monkeypatch.setattr(caches.stores, "maxsize", 3)
    for i in range(5):
        caches.store_for(f"ns{i}")  # no Redis traffic: a Store connects on first use
    assert set(caches.stores) == {"ns2", "ns3", "ns4"}
    caches.forget_namespace("ns3")
    assert set(caches.stores) == {"ns2", "ns4"}

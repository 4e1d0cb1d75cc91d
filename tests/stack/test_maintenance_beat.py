"""The per-namespace beat loop (maintenance.beat.each_namespace): every namespace has its
turn whatever fails; a failure is logged, forgets the namespace's state in this process and
is raised at the end as one ``MaintenanceError`` naming each; a namespace dropped during its
pass is skipped, not a failure."""

from __future__ import annotations

import logging

import pytest

from claw_tasks.settings import use_settings
from claw_tasks.store import NamespaceDropped, Store
from claw_tasks.worker import context
from orchestrator.maintenance.beat import MaintenanceError, each_namespace


class Part:
    closed = False

    def close(self, dropped: bool) -> None:
        self.closed = True


def test_every_namespace_has_its_turn_and_failures_are_raised_together(
    own_redis_url, monkeypatch, caplog
):
    monkeypatch.setenv("CLAW_REDIS_URL", own_redis_url)
    use_settings()
    for ns in ("a-fails", "b-works", "c-idle", "d-dropped"):
        Store(own_redis_url, ns).create(capacity=10)
    parts = {ns: context.context_for(ns).part("test", Part) for ns in ("a-fails", "d-dropped")}
    seen = []

    def work(store: Store) -> int | None:
        seen.append(store.namespace)
        if store.namespace == "a-fails":
            raise ValueError("broken")
        if store.namespace == "d-dropped":
            raise NamespaceDropped(store.namespace)
        return 7 if store.namespace == "b-works" else None

    with caplog.at_level(logging.ERROR), pytest.raises(MaintenanceError) as err:
        each_namespace("test pass", work)
    assert seen == ["a-fails", "b-works", "c-idle", "d-dropped"]
    assert err.value.failed == {"a-fails": "ValueError: broken"}
    assert err.value.done == {"b-works": 7}
    assert "test pass failed in 1 namespace(s)" in str(err.value) and "a-fails" in str(err.value)
    assert "test pass in a-fails failed" in caplog.text and "ValueError: broken" in caplog.text
    assert parts["a-fails"].closed and parts["d-dropped"].closed  # both start cold
    assert each_namespace("test pass", lambda store: store.namespace[0]) == {
        "a-fails": "a",
        "b-works": "b",
        "c-idle": "c",
        "d-dropped": "d",
    }
    with pytest.raises(MaintenanceError) as err:  # asked for by name, it must exist
        each_namespace("test pass", lambda store: store.count(), ["b-works", "e-absent"])
    assert list(err.value.failed) == ["e-absent"] and err.value.done == {"b-works": 0}
    for ns in ("a-fails", "b-works", "c-idle", "d-dropped"):
        context.forget(ns)

"""The per-namespace beat loop (maintenance.beat.each_namespace): every namespace has its
turn whatever fails; a failure is logged, forgets the namespace's state in this process
(the host's shared sampling index stays valid for the others) and is raised at the end as
one ``MaintenanceError`` naming each, which survives Celery's trip between processes; a
namespace dropped during its pass is skipped, not a failure."""

from __future__ import annotations

import importlib
import logging
import pickle

import numpy as np
import pytest
from celery.utils.serialization import get_pickleable_exception

from claw_tasks.settings import use_settings
from claw_tasks.store import NamespaceDropped, Store
from claw_tasks.store.snapshot_format import SnapshotError
from claw_tasks.worker import context
from orchestrator.maintenance.beat import MaintenanceError, each_namespace
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.shared import H_DIRTY, SharedIndex, index_key
from orchestrator.sampling.shmfiles import SHM_DIR
from tests.support.stepdata import batch, episode

# The module (``orchestrator.sampling.sample`` the attribute is the function).
sampling = importlib.import_module("orchestrator.sampling.sample")


class Part:
    def __init__(self) -> None:
        self.closed: list[bool] = []

    def close(self, dropped: bool) -> None:
        self.closed.append(dropped)


def test_every_namespace_has_its_turn_and_failures_are_raised_together(
    own_redis_url, monkeypatch, caplog
):
    monkeypatch.setenv("CLAW_REDIS_URL", own_redis_url)
    use_settings()
    for ns in ("a-fails", "b-works", "c-idle", "d-dropped", "e-no-snapshot"):
        Store(own_redis_url, ns).create(capacity=10)
    parts = {ns: context.context_for(ns).part("test", Part) for ns in ("a-fails", "d-dropped")}
    seen = []

    def work(store: Store) -> int | None:
        seen.append(store.namespace)
        if store.namespace == "a-fails":
            raise ValueError("broken")
        if store.namespace == "d-dropped":
            store.mark_dropped()  # by another process, during the pass
            raise NamespaceDropped(store.namespace)
        if store.namespace == "e-no-snapshot":  # a NamespaceError of a namespace that exists
            raise SnapshotError("no snapshot 'x'")
        return 7 if store.namespace == "b-works" else None

    with caplog.at_level(logging.ERROR), pytest.raises(MaintenanceError) as err:
        each_namespace("test pass", work)
    assert seen == ["a-fails", "b-works", "c-idle", "d-dropped", "e-no-snapshot"]
    assert err.value.failed == {
        "a-fails": "ValueError: broken",
        "e-no-snapshot": "SnapshotError: no snapshot 'x'",
    }
    assert err.value.done == {"b-works": 7}
    assert "test pass failed in 2 namespace(s)" in str(err.value) and "a-fails" in str(err.value)
    assert "test pass in a-fails failed" in caplog.text and "ValueError: broken" in caplog.text
    assert parts["a-fails"].closed == [False]  # starts cold here, the others keep theirs
    assert parts["d-dropped"].closed == [True]  # gone for every process
    assert each_namespace("test pass", lambda store: store.namespace[0]) == {
        "a-fails": "a",
        "b-works": "b",
        "c-idle": "c",
        "e-no-snapshot": "e",
    }
    with pytest.raises(MaintenanceError) as err:  # asked for by name, it must exist
        each_namespace("test pass", lambda store: store.count(), ["b-works", "e-absent"])
    assert list(err.value.failed) == ["e-absent"] and err.value.done == {"b-works": 0}
    for ns in ("a-fails", "b-works", "c-idle", "d-dropped", "e-no-snapshot"):
        context.forget(ns, dropped=False)


def test_the_error_survives_celerys_trip_between_processes():
    err = MaintenanceError("test pass", {"a": "ValueError: broken"}, {"b": object()})
    for back in (
        pickle.loads(pickle.dumps(err)),  # a pool process to its parent
        type(err)(*err.args),  # a JSON result: rebuilt from its args
        get_pickleable_exception(err),  # what Celery sends: itself, no stand-in
    ):
        assert type(back) is MaintenanceError and str(back) == str(err)
        assert back.what == "test pass" and back.failed == {"a": "ValueError: broken"}
    assert "test pass failed in 1 namespace(s)" in str(err) and err.done.keys() == {"b"}


def test_a_failing_pass_leaves_the_shared_index_valid(own_redis_url, monkeypatch):
    monkeypatch.setenv("CLAW_REDIS_URL", own_redis_url)
    use_settings()
    store = Store(own_redis_url, "shared")
    store.create(capacity=100)
    store.commit(batch(episode(0, 10, "terminated")))
    recipe = Recipe.model_validate(
        {"name": "u", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
    )
    sampling.sample("shared", recipe, redis_url=own_redis_url, rng=np.random.default_rng(0))
    session = context.context_for("shared").part(sampling.SESSION, dict)
    assert isinstance(session.index, SharedIndex)  # this process uses the host's index
    other = SharedIndex(Store(own_redis_url, "shared"))  # another process's, kept open
    other.sync()
    other.release()
    ctl = SHM_DIR / f"clawidx-{index_key(store)}.ctl"

    def fails(store: Store) -> None:
        raise ValueError("broken")

    with pytest.raises(MaintenanceError):
        each_namespace("test pass", fails)
    assert "shared" not in {key[-2] for key in context.contexts}  # this process: cold
    assert np.fromfile(ctl, np.int64, 16)[H_DIRTY] == 0  # the others: still valid

    def dropped(store: Store) -> None:
        store.mark_dropped()  # by another process, during the pass
        raise NamespaceDropped(store.namespace)

    sampling.sample("shared", recipe, redis_url=own_redis_url, rng=np.random.default_rng(0))
    assert each_namespace("test pass", dropped) == {}
    assert np.fromfile(ctl, np.int64, 16)[H_DIRTY] == 1  # gone: every process rebuilds
    other.close()

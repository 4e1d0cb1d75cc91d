"""The per-namespace beat loop: :func:`each_namespace`, which every maintenance task that
works namespace by namespace runs (priorities, evict, clean, vectors, lineage, quality,
archive).

One namespace failing must not stop the others, and must still show: each failure is
logged with its traceback, the namespace's state in this process is forgotten (its next
pass starts cold, from Redis, not from what the failure left; the other processes keep
theirs: a lasting error does not make every process rebuild the host's shared sampling
index on every tick), and once every namespace had its turn the task raises
:class:`MaintenanceError` naming each failure, so Flower lists the run FAILED with them. A
namespace dropped during its pass is forgotten (for every process of the host) and
skipped: not a failure (a ``NamespaceError`` of a namespace that still exists, a missing
snapshot say, is one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.keyscan import list_namespaces
from claw_tasks.worker.context import forget, redis_client, store_for

T = TypeVar("T")
log = logging.getLogger(__name__)


class MaintenanceError(RuntimeError):
    """A maintenance pass failed in some namespaces: ``failed`` maps each to its error,
    ``done`` holds what the others returned.

    Its ``args`` are the pass and its failures, so Celery rebuilds it (by pickle between
    a pool process and its parent, or from ``args`` for a JSON result) as itself, not as
    a stand-in; ``done`` (any values) stays in the process that ran the pass."""

    def __init__(
        self, what: str, failed: dict[str, str], done: dict[str, Any] | None = None
    ) -> None:
        super().__init__(what, failed)
        self.what, self.failed, self.done = what, failed, done or {}

    def __str__(self) -> str:
        return f"{self.what} failed in {len(self.failed)} namespace(s): {self.failed}"

    def __reduce__(self) -> tuple[type[MaintenanceError], tuple[str, dict[str, str]]]:
        return type(self), (self.what, self.failed)


def each_namespace(
    what: str, work: Callable[[Store], T | None], names: Sequence[str] | None = None
) -> dict[str, T]:
    """Run ``work`` on the ``Store`` of every namespace (or of ``names``: then one that
    does not exist is a failure), as the module docstring says; returns what it returned
    per namespace, None (nothing to do there) left out. ``what`` names the pass in the log
    and the error."""
    done: dict[str, T] = {}
    failed: dict[str, str] = {}
    for ns in list_namespaces(redis_client()) if names is None else names:
        try:
            out = work(store_for(ns))
        except Exception as e:
            # dropped meanwhile: a NamespaceError of a namespace that is gone (one more
            # round trip, on failure only); any other (a missing snapshot, say) is a failure
            dropped = names is None and isinstance(e, NamespaceError) and not _exists(ns)
            forget(ns, dropped=dropped)  # its next pass starts cold, from Redis
            if dropped:
                continue
            log.exception("%s in %s failed", what, ns)
            failed[ns] = f"{type(e).__name__}: {e}"
            continue
        if out is not None:
            done[ns] = out
    if failed:
        raise MaintenanceError(what, failed, done)
    return done


def _exists(namespace: str) -> bool:
    try:
        return store_for(namespace).exists()
    except Exception:  # the store is unreachable: report the failure, do not skip it
        return True

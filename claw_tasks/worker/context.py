"""A process's state of each namespace it serves, in one object: :class:`NamespaceContext`.

A worker (ingest, prefetch, maintenance) or a trainer calling ``sample`` lives for days
and may serve many namespaces. Per (Redis server, namespace, pid) it keeps one context:
the namespace's ``Store`` and the parts the read path builds on it — the sampling session
(its index and samplers), the augmentation plans of its recipes, its retrieval sessions,
the maintenance index and the vector writers. The orchestrator's layers put their parts
in the context by name (claw_tasks never imports them), so a namespace's state is
forgotten in one place, :func:`forget`, whatever made it stale: the namespace was dropped
or made again (``dropped``: a part shared with other processes is invalidated for them
too), or a maintenance pass failed in it (only this process's parts start cold). Each
part that reads the config catches a namespace made again itself: the maintenance index
through :meth:`NamespaceContext.check_created`, the sampling and retrieval sessions by the
creation time they read with their log. A recipe that changes is caught by the part that
serves it (its sampler rebound, its plan rebuilt) and leaves the others warm.

Bounded by count and by bytes: the ``namespace_cache_size`` most recently used contexts
are kept, and of those only as many, least recently used let go first, as fit
``worker_cache_bytes`` together (an evicted one is rebuilt cold from Redis on next use); a
part that grows with recipes or indexes bounds itself (an ``LRU``). A context's bytes are
weighed (:func:`weigh`) when the process turns from it to another namespace: only the
context in use grows, so the others' weights stay exact, and the one in use is never let
go (a single namespace larger than the budget still works). The process then holds at most
the budget plus the context in use. A forked child builds its own contexts: the pid is in
the key, so it never shares the parent's locks, random streams or connections.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from claw_tasks.connection import client as connect
from claw_tasks.connection.client import Client, identity
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.worker.lru import LRU

T = TypeVar("T")
log = logging.getLogger(__name__)


@runtime_checkable
class Part(Protocol):
    """A part of a context that holds something to let go of when it is forgotten."""

    def close(self, dropped: bool) -> None:
        """Let go of what it holds. ``dropped``: the namespace's data is gone or was made
        again, so a part shared with other processes (the host's shared sampling index)
        makes them rebuild; else only this process lets go (they keep theirs warm)."""


def _close_parts(parts: list[Any], dropped: bool) -> None:
    """Close each :class:`Part` of ``parts``, and of an ``LRU`` among them (a part of parts,
    emptied); others are simply let go. One failing is logged and the rest are still closed
    (each may hold files or locks of the host)."""
    for part in parts:
        if isinstance(part, LRU):
            _close_parts(part.pop_where(lambda key: True), dropped)
        elif isinstance(part, Part):
            try:
                part.close(dropped)
            except Exception:
                log.exception("closing %r failed", part)


class NamespaceContext:
    """One namespace's ``Store`` and the parts built on it in this process; a :class:`Part`
    is closed when the context is forgotten."""

    def __init__(self, store: Store) -> None:
        self.store, self.namespace = store, store.namespace
        self.created: float | None = None  # the config creation time the parts were built on
        self._parts: dict[Hashable, Any] = {}
        self._lock = threading.RLock()  # a part's maker may ask for another part

    def part(self, name: Hashable, make: Callable[[], T]) -> T:
        """The part ``name``, made by ``make()`` on first use."""
        with self._lock:
            if name not in self._parts:
                self._parts[name] = make()
            return self._parts[name]

    def check_created(self, created: float) -> bool:
        """Whether the parts were built on the namespace as configured at ``created`` (its
        config's creation time, just read). A namespace made again since is forgotten in this
        process (:func:`forget`, ``dropped``) and False returned: the caller starts afresh
        from a new context."""
        with self._lock:
            if self.created is None or self.created == created:
                self.created = created
                return True
        forget(self.namespace, dropped=True)
        return False

    def close(self, dropped: bool) -> None:
        """Close every part (each whatever another raised) and forget them all."""
        with self._lock:
            parts, self._parts = list(self._parts.values()), {}
        _close_parts(parts, dropped)


_lock = threading.Lock()
_clients: dict[tuple[str, int], tuple[Client, tuple[Any, ...]]] = {}


def _let_go(ctx: NamespaceContext) -> None:
    """Close a context pushed out by the count, unless a thread is using it (then it is
    simply dropped, as a part in use must not be closed under it)."""
    if not any(c is ctx for _, c in list(_budget.using.values())):
        ctx.close(dropped=False)


contexts: LRU[tuple[Any, ...], NamespaceContext] = LRU(
    get_settings().namespace_cache_size, on_evict=_let_go
)
"""This process's contexts by (server identity..., namespace, pid); one pushed out by the
count is closed (its shared-memory mappings and files released now, not at a collection)."""


def _client(url: str | None) -> tuple[Client, tuple[Any, ...]]:
    """This process's client of the data store at ``url`` (default ``CLAW_REDIS_URL``) and
    the server's identity; one per URL and pid, made lazily (so each prefork child gets its
    own connection pool)."""
    key = (url or get_settings().redis_url, os.getpid())
    with _lock:
        found = _clients.get(key)
        if found is None:
            client = connect.redis_client(key[0])
            found = _clients[key] = (client, identity(client))
        return found


def redis_client(url: str | None = None) -> Client:
    """This process's client of the data store (``CLAW_REDIS_URL`` by default): for tasks
    that need Redis but no namespace, like the beat's refill."""
    return _client(url)[0]


def context_for(target: str | Store, redis_url: str | None = None) -> NamespaceContext:
    """This process's context of a namespace: ``target`` names it (on ``redis_url``,
    default ``CLAW_REDIS_URL``) or is a ``Store`` of it (the context's store is then the
    first one given for that server)."""
    if isinstance(target, Store):
        key = (*identity(target.r), target.namespace, os.getpid())
        ctx = contexts.get(key, lambda: NamespaceContext(target))
    else:
        client, server = _client(redis_url)
        key = (*server, target, os.getpid())
        ctx = contexts.get(key, lambda: NamespaceContext(Store(client, target)))
    _budget.use(key, ctx)
    return ctx


WEIGH_DEPTH = 6
"""How deep :func:`weigh` follows attributes and containers from a part."""


def weigh(obj: Any) -> int:
    """Bytes ``obj`` holds in arrays: an object's own ``nbytes`` when it states one (numpy
    arrays, a vector index with its Faiss lists), else the sum over its items and, for
    Claw's own classes, its attributes, each array counted once. An array mapped from a
    file (the host's shared sampling index in ``/dev/shm``) counts whole: its pages are in
    this process's RSS once touched, and a sampler touches all of them."""
    seen: set[int] = set()

    def walk(o: Any, depth: int) -> int:
        if id(o) in seen or depth > WEIGH_DEPTH or o is None:
            return 0
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            base = o.base
            if isinstance(base, np.ndarray):  # a view: its base counts (once)
                return walk(base, depth)
            return o.nbytes
        if isinstance(o, (str, bytes, bytearray, int, float, bool)):
            return 0
        if isinstance(o, LRU):
            return sum(walk(v, depth + 1) for v in o.values())
        if isinstance(o, dict):
            return sum(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple, set, frozenset)):
            return sum(walk(v, depth + 1) for v in o)
        stated = getattr(type(o), "nbytes", None)
        if isinstance(stated, property):
            return int(o.nbytes)
        if type(o).__module__.startswith(("orchestrator.", "claw_tasks.")):
            return sum(walk(v, depth + 1) for v in getattr(o, "__dict__", {}).values())
        return 0

    return walk(obj, 0)


class _Budget:
    """Let contexts go, least recently used first, while their weights exceed
    ``worker_cache_bytes`` (see the module docstring). "In use" is per thread: the
    context each live thread asked for last is never weighed or let go (a process whose
    threads serve different namespaces, say a trainer's ``nearest`` calls)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.weights: dict[tuple[Any, ...], int] = {}
        self.using: dict[int, tuple[tuple[Any, ...], NamespaceContext]] = {}
        """Thread ident -> the context that thread asked for last."""
        self.evicted = 0  # contexts let go for bytes (tests, stats)

    def use(self, key: tuple[Any, ...], ctx: NamespaceContext) -> None:
        me = threading.get_ident()
        last = self.using.get(me)
        if last is not None and last[0] == key:
            return
        with self.lock:
            self.using[me] = (key, ctx)
            alive = {t.ident for t in threading.enumerate()}
            for gone in set(self.using) - alive:
                del self.using[gone]
            in_use = {k for k, _ in self.using.values()}
            if last is not None and last[0] in contexts and last[0] not in in_use:
                self.weights[last[0]] = weigh(last[1])
            held = list(contexts)  # least recently used first
            for gone in set(self.weights) - set(held):
                del self.weights[gone]
            total, budget = sum(self.weights.values()), get_settings().worker_cache_bytes
            if total <= budget:
                return
            drop = []
            for k in held:
                if total <= budget:
                    break
                if k not in in_use and k in self.weights:
                    total -= self.weights.pop(k)
                    drop.append(k)
        if not drop:  # only contexts in use are over the budget: nothing to let go
            return
        for old in contexts.pop_where(lambda k: k in drop):
            old.close(dropped=False)
            self.evicted += 1
        gc.collect()  # parts refer to each other (an index and its subscribers): free now


_budget = _Budget()


def store_for(namespace: str) -> Store:
    """This process's ``Store`` of ``namespace`` on ``CLAW_REDIS_URL``."""
    return context_for(namespace).store


def forget(namespace: str, *, dropped: bool) -> None:
    """Forget every part this process keeps of ``namespace``, on every server. ``dropped``:
    it was dropped or made again, so a part shared with other processes is invalidated for
    them too (they rebuild on their next sync); else (a pass over it failed) only this
    process starts cold, and a shared index stays valid for the others: a lasting error
    must not make every process of the host rebuild on every beat tick."""
    for ctx in contexts.pop_where(lambda key: key[-2] == namespace):
        ctx.close(dropped)


def close_all() -> None:
    """Close every context (a worker process exiting): the last process of a host to leave
    a shared sampling index removes its files from ``/dev/shm``."""
    for ctx in contexts.pop_where(lambda key: True):
        ctx.close(dropped=False)

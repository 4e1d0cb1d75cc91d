"""Prefetch: sample a recipe, fetch payloads, augment, collate, encode, push to its queue.

Runs on the ``prefetch`` queue. A ``fill`` task tops one recipe's queue up to its depth,
batch by batch, and stops early when the rate limit says wait or data is short; the state
is kept in the recipe's counters (``BatchClient.stats``). One fill per recipe runs at a
time (the refill lock, taken with a token by whoever sends the task and released, if still
its own, when it ends). Collation (:mod:`orchestrator.delivery.collate`): ragged fields become
zero-padded arrays plus ``<name>_lengths``, strings and ``info`` go to the batch's ``meta``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from celery.signals import worker_process_init, worker_process_shutdown, worker_shutdown

from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceError
from claw_tasks.worker.app import app
from claw_tasks.worker.context import close_all, context_for, forget, store_for
from claw_tasks.worker.lru import LRU
from claw_tasks.worker.tasks import committed
from orchestrator.delivery import admission, rollouts, shm
from orchestrator.delivery.augstats import RedisStats, namespace_stats
from orchestrator.delivery.ratelimit import Room
from orchestrator.delivery.registry import ACTIVE, PRODUCED, SAMPLED, Registry
from orchestrator.delivery.samplestats import Observed
from orchestrator.delivery.stages import Pipeline
from orchestrator.recipe.model import Recipe
from orchestrator.sampling import groups
from orchestrator.sampling.groups import Claim
from orchestrator.sampling.shmfiles import Kind, reap_orphans
from orchestrator.transforms.augment import AugmentPlan, build_pipelines

log = logging.getLogger(__name__)
_rng = np.random.default_rng()


@worker_process_init.connect
def _seed_child(**_: Any) -> None:
    """Each prefork child gets its own random stream (not a copy of the parent's)."""
    global _rng
    _rng = np.random.default_rng()
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:  # pragma: no cover - cv2 comes with albumentations
        pass


@worker_process_shutdown.connect
def _detach_indexes(**_: Any) -> None:
    """A pool process stopping detaches from the host's shared sampling indexes, so the
    last one removes their files (a process killed outright leaves them to the reaper)."""
    close_all()


@worker_shutdown.connect
def _reap_left_indexes(**_: Any) -> None:
    """The pool has stopped (the main process, after it joined its pool processes): remove
    this host's index files that no process holds any more. A pool process whose exit was
    cut short (a second SIGTERM while it detached: systemd's and ``kill -- -PGID``'s
    signal reaches every process of the group, then the main process terminates its pool)
    could not remove them itself."""
    try:
        reap_orphans(kinds=Kind.INDEX)
    except OSError:
        log.warning("reaping unused index files at shutdown failed", exc_info=True)


PLANS = "augment plans"
"""The augmentation plans' name in a namespace context: an ``LRU`` of recipe name ->
(digest of its ``augment`` section, plan), the ``plan_cache_size`` most recently used."""
REAP_EVERY_S = 60.0
_last_reap = -math.inf


def _augment_digest(augment: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(augment, sort_keys=True).encode()).hexdigest()


def _plan(reg: Registry, recipe: Recipe) -> AugmentPlan | None:
    """The recipe's augmentation pipelines, kept in the namespace's context (the
    ``plan_cache_size`` most recently used recipes) while its ``augment`` section stays the
    same. Their running statistics live in Redis (:mod:`orchestrator.delivery.augstats`):
    every worker of the recipe, and a restarted one, normalises with the same ones."""
    plans: LRU[str, tuple[str, AugmentPlan | None]] = context_for(reg.store).part(
        PLANS, lambda: LRU(get_settings().plan_cache_size)
    )
    key, digest = recipe.name, _augment_digest(recipe.augment)
    cached = plans.get(key, lambda: ("", None))
    if cached[0] != digest:
        stats = RedisStats(reg.r, reg.augment_stats(recipe.name), digest)
        shared = namespace_stats(reg.store)
        plan = (
            build_pipelines(recipe.augment, stats=stats, namespace_stats=shared)
            if recipe.augment
            else None
        )
        cached = (digest, plan)
        plans.put(key, cached)
    return cached[1]


def _rng_for(reg: Registry, recipe: Recipe) -> np.random.Generator:
    """The recipe's seeded stream for its k-th batch (reproducible on any worker), or this
    process's own stream when the recipe has no seed."""
    if recipe.seed is None:
        return _rng
    k = reg.r.hincrby(reg.counters(recipe.name), "batch_seq", 1)
    return np.random.default_rng([recipe.seed, recipe.version, k])


def push(
    reg: Registry,
    recipe: Recipe,
    item: bytes,
    counts: Mapping[str, float] | None = None,
    claim: Claim | None = None,
    served: list[str] | None = None,
) -> int | str:
    """Append ``item`` and count it (``counts``: more counter increments, e.g. served
    staleness), in one transaction that also reads the recipe's current version; returns
    the queue length, or why the item was taken back: ``"stale"`` (the recipe changed while
    this batch was made), ``"unregistered"`` or ``"full"`` (a second fill slipped in).
    ``served``: the trajectories the batch serves (an ``admission`` recipe's), taken out of
    admission's done set in the same transaction. An item taken back gives back the groups
    it claimed (``claim``, a ``once`` batch's) and puts back the trajectories it took; one
    a reader popped first is that reader's to give back. No Lua: a script's arguments cost
    ~2 ms per MB here, RPUSH ~0.1 ms."""
    name, rows = recipe.name, recipe.batch_size
    queue, counters = reg.queue(name), reg.counters(name)
    counts = counts or {}
    with reg.r.pipeline(transaction=True) as pipe:
        pipe.rpush(queue, item)
        pipe.hget(reg.versions_key, name)
        pipe.exists(reg.recipe_key(name))
        pipe.hincrby(counters, PRODUCED, 1)
        pipe.hincrby(counters, SAMPLED, rows)
        for k, v in counts.items():
            pipe.hincrbyfloat(counters, k, v)
        if served:
            admission.serve(pipe, reg.store, served, None if claim is None else claim.token)
        got = pipe.execute()
        length, version, registered = got[:3]
        removed = got[-1] if served else []
    if not registered:  # unregistered while we sampled: take back what is there
        for left in reg.drain(name):
            shm.discard(left)
        return "unregistered"
    if version is not None and int(version) != recipe.version:
        why = "stale"
    elif length > recipe.prefetch.depth:
        why = "full"
    else:
        return int(length)
    # ours, wherever it is now (a reader that popped it first drops it as stale, or
    # serves it: a full queue's one more batch is not wrong)
    taken = reg.r.lrem(queue, -1, item)
    if taken:
        shm.discard(item)
    if taken and claim is not None:
        groups.release(reg.store, name, [claim])
    if taken and served and claim is None:
        admission.unserve(reg.store, removed)
    elif taken and served:  # the claim's record: read once, by whoever gets it first
        admission.unclaimed(reg.store, [claim.token])
    if taken:
        with reg.r.pipeline(transaction=False) as pipe:
            pipe.hincrby(counters, PRODUCED, -1)
            pipe.hincrby(counters, SAMPLED, -rows)
            for k, v in counts.items():
                pipe.hincrbyfloat(counters, k, -v)
            pipe.execute()
    return why


def run_fill(reg: Registry, name: str) -> dict[str, Any]:
    """Top up ``name``'s queue; returns what happened (also recorded in its counters as
    ``state``). Each batch is made by the recipe's stages (:mod:`orchestrator.delivery.
    stages`) while the queue has room and the rate limit allows; a rollout recipe's fill
    forms and serves its rollout instead (:mod:`orchestrator.delivery.rollouts`). Any
    failure ends the fill with ``state`` ``"error: ..."``, logged once."""
    made, state, before = 0, "full", ""
    seen = Observed()
    try:
        entry = reg.get(name)
        if entry is None:
            return {"made": 0, "state": "unregistered"}
        recipe = entry.recipe
        if recipe.rollout is not None:
            made, state = rollouts.run(reg, entry, _plan(reg, recipe))
            reg.bump(name, state=state)
            return {"made": made, "state": state}
        room = Room(reg, recipe)  # first: its state is what a failure below is compared to
        before = room.last_state
        stages = Pipeline.of(reg.store, entry, _plan(reg, recipe), seen)
        while (why := room.why_not(made)) is None:
            draft = stages.make(_rng_for(reg, recipe))
            if draft.end is not None:
                why = draft.end
                break
            pushed = push(reg, recipe, draft.message, draft.counts, draft.batch.claim, draft.served)
            if pushed == "full":
                break
            if isinstance(pushed, str):  # stale or unregistered: the new fill reports state
                stages.taken_back(draft, pushed)
                return {"made": made, "state": f"stopped: recipe {pushed}"}
            room.pushed(pushed)
            made, state = made + 1, "ok"
        state = why or state
    except NamespaceError as e:
        state = f"insufficient data: {e}"
    except Exception as e:  # recorded for stats/CLI; the beat will try again
        state = f"error: {type(e).__name__}: {e}"
        if state != (before or _last_state(reg, name)):  # once, not on every retry
            log.exception("prefetch of %s/%s failed", reg.ns, name)
    reg.bump(name, **seen.fields(), state=state)
    return {"made": made, "state": state}


@committed.connect
def form_waiting_rollouts(namespace: str, **_: Any) -> None:
    """Steps were committed in ``namespace`` by this process: sweep its rollout recipes that
    wait for steps here and now, forming and serving a rollout the commit completed (no
    fill waits in a pool process for them, no task is sent: rollouts.py). One ``SMEMBERS``
    per commit when none waits."""
    reg = Registry(store_for(namespace))
    for name in rollouts.waiting(reg):
        run_fill(reg, name)  # its state recorded, an error logged once


class FillError(RuntimeError):
    """A fill failed (its ``state`` in the recipe's counters says the same)."""


def _last_state(reg: Registry, name: str) -> str:
    try:
        return str(reg.counts(name).get("state", ""))
    except Exception:  # Redis itself failing: log the error anyway
        return ""


def _reap_orphans() -> None:
    """Reclaim this host's orphaned shm segments and unused index files, at most every
    ``REAP_EVERY_S`` per process (the maintenance beat may run on another host)."""
    global _last_reap
    now = time.monotonic()
    if now - _last_reap < REAP_EVERY_S:
        return
    _last_reap = now
    try:
        reap_orphans()
    except OSError:
        log.warning("reaping orphaned /dev/shm files failed", exc_info=True)


@app.task(name="claw.prefetch.fill", acks_late=False, ignore_result=True)
def fill(namespace: str, name: str, token: str) -> dict[str, Any]:
    """Fill one recipe's queue (sent by ``BatchClient.pop`` below low water, and by beat)
    with the refill lock's ``token``: released only while still this fill's. A failed fill
    raises (after recording its state), so Flower lists it as FAILED."""
    reg = Registry(store_for(namespace))
    try:
        reg.r.sadd(ACTIVE, namespace)  # the beat tops this namespace up from now on
        result = run_fill(reg, name)
    finally:
        reg.release_refill_lock(name, token)
        _reap_orphans()
    if result["state"] == "unregistered" and not reg.store.exists():  # dropped
        reg.r.srem(ACTIVE, namespace)
        forget(namespace, dropped=True)
    if str(result["state"]).startswith("error:"):  # FAILED in Flower, not a quiet success
        raise FillError(f"prefetch of {namespace}/{name} failed: {result['state'][7:]}")
    return result

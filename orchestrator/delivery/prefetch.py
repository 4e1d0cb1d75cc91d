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
from functools import partial
from typing import Any

import numpy as np
from celery.signals import worker_process_init, worker_process_shutdown

from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceError
from claw_tasks.worker.app import app
from claw_tasks.worker.caches import forget_namespace as forget_store
from claw_tasks.worker.caches import store_for
from claw_tasks.worker.lru import LRU
from claw_tasks.worker.tasks import committed
from orchestrator.delivery import admission, ratelimit, rollouts, shm
from orchestrator.delivery.augstats import RedisStats, namespace_stats
from orchestrator.delivery.collate import collate
from orchestrator.delivery.quarantine import sample_clean
from orchestrator.delivery.registry import ACTIVE, Registry
from orchestrator.delivery.samplestats import Observed
from orchestrator.delivery.tokens import collate_tokens, group_arrays
from orchestrator.delivery.wire import Pending, to_wire
from orchestrator.recipe.model import Recipe
from orchestrator.retrieval.query import neighbour_fields
from orchestrator.sampling import groups
from orchestrator.sampling.batch import take_rows
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.groups import Claim
from orchestrator.sampling.sample import close_shared, hit_rates
from orchestrator.sampling.sample import forget_namespace as forget_sessions
from orchestrator.sampling.shared import reap_unused
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
    close_shared()


plans: LRU[tuple[str, str], tuple[str, AugmentPlan | None]] = LRU(get_settings().plan_cache_size)
REAP_EVERY_S = 60.0
_last_reap = -math.inf


def _augment_digest(augment: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(augment, sort_keys=True).encode()).hexdigest()


def _plan(reg: Registry, recipe: Recipe) -> AugmentPlan | None:
    """The recipe's augmentation pipelines, kept per process (the ``plan_cache_size`` most
    recently used recipes) while its ``augment`` section stays the same. Their running
    statistics live in Redis (:mod:`orchestrator.delivery.augstats`): every worker of the
    recipe, and a restarted one, normalises with the same ones."""
    key, digest = (reg.ns, recipe.name), _augment_digest(recipe.augment)
    cached = plans.get(key, lambda: ("", None))
    if cached[0] != digest:
        stats = RedisStats(reg.r, reg.augment_stats(recipe.name), digest)
        shared = namespace_stats(reg.r, reg.store.owned_key(""))
        plan = (
            build_pipelines(recipe.augment, stats=stats, namespace_stats=shared)
            if recipe.augment
            else None
        )
        cached = (digest, plan)
        plans.put(key, cached)
    return cached[1]


def forget_namespace(namespace: str) -> None:
    """Drop this process's augmentation plans of ``namespace``'s recipes (call when it is
    deleted)."""
    plans.drop(lambda key: key[0] == namespace)


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
) -> int | str:
    """Append ``item`` and count it (``counts``: more counter increments, e.g. served
    staleness), in one transaction that also reads the recipe's current version; returns
    the queue length, or why the item was taken back: ``"stale"`` (the recipe changed while
    this batch was made), ``"unregistered"`` or ``"full"`` (a second fill slipped in). An
    item taken back gives back the groups it claimed (``claim``, a ``once`` batch's); one a
    reader popped first is that reader's to give back. No Lua: a script's arguments cost
    ~2 ms per MB here, RPUSH ~0.1 ms."""
    name, rows = recipe.name, recipe.batch_size
    queue, counters = reg.queue(name), reg.counters(name)
    counts = counts or {}
    with reg.r.pipeline(transaction=True) as pipe:
        pipe.rpush(queue, item)
        pipe.hget(reg.versions_key, name)
        pipe.exists(reg.recipe_key(name))
        pipe.hincrby(counters, "produced", 1)
        pipe.hincrby(counters, "sampled", rows)
        for k, v in counts.items():
            pipe.hincrbyfloat(counters, k, v)
        length, version, registered = pipe.execute()[:3]
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
        groups.release(reg.r, reg.base, name, [claim])
    if taken:
        with reg.r.pipeline(transaction=False) as pipe:
            pipe.hincrby(counters, "produced", -1)
            pipe.hincrby(counters, "sampled", -rows)
            for k, v in counts.items():
                pipe.hincrbyfloat(counters, k, -v)
            pipe.execute()
    return why


def _stats_field(name: str) -> str:
    """The field carrying the version of the namespace statistics ``name`` was normalised with."""
    return f"stats_version.{name}"


def _versions(plan: AugmentPlan | None) -> dict[str, int]:
    return plan.stats_versions() if plan is not None else {}


def _augment_into(
    plan: AugmentPlan,
    fields: Mapping[str, Any],
    rng: np.random.Generator,
    out: dict[str, np.ndarray],
) -> None:
    """Augment ``fields`` into ``out`` (views of the laid-out batch), then write the
    statistics versions the plan used."""
    plan.apply(fields, rng, out={f: out[f] for f in plan.fields})
    for f, version in plan.stats_versions().items():
        out[_stats_field(f)][:] = version


def run_fill(reg: Registry, name: str) -> dict[str, Any]:
    """Top up ``name``'s queue; returns what happened (also recorded in its counters as
    ``state``). Any failure ends the fill with ``state`` ``"error: ..."``, logged once."""
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
        depth, rows = recipe.prefetch.depth, recipe.batch_size
        # Read once per fill and tracked here; looked at again only before giving up.
        length, inserted, sampled, before = reg.fill_state(name)
        fresh = True
        plan = _plan(reg, recipe)
        draw, versions_added = recipe, False
        if recipe.admission is not None and "policy_version" not in recipe.fields:
            # served staleness needs each row's version (metadata: no payload read)
            draw = recipe.model_copy(update={"fields": [*recipe.fields, "policy_version"]})
            versions_added = True
        while made < depth and length < depth:
            verdict = ratelimit.check(recipe.rate_limit, inserted, sampled, rows)
            if not verdict and not fresh:
                length, inserted, sampled, _ = reg.fill_state(name)
                fresh = True
                continue
            if not verdict:
                state = f"rate limited: {verdict.reason}"
                break
            fresh = False
            rng = _rng_for(reg, recipe)
            began = time.perf_counter()
            try:
                batch = sample_clean(reg.store, draw, rng)  # its clean rules passed
            except InsufficientData as e:
                state = f"insufficient data: {e}"
                break
            counts: dict[str, float] = {}
            if recipe.admission is not None:
                versions = (
                    batch.fields.pop("policy_version")
                    if versions_added
                    else batch.fields["policy_version"]
                )
                counts = admission.staleness_counts(recipe, np.asarray(versions))
            if recipe.nearest is not None:  # queried with the states as drawn
                near = recipe.nearest
                got = neighbour_fields(reg.store, near, batch.fields[near.query], batch.ids)
                batch.fields.update(got)
            ids, weights, source_index = batch.ids, batch.weights, batch.source_index
            meta = batch.meta
            specs = None
            if plan is not None and recipe.tokens is None:
                specs = plan.out_specs(batch.fields)
            if specs is not None:  # laid out first, then augmented in place
                fields = dict(batch.fields)
                fields.update({f: Pending(*spec) for f, spec in specs.items()})
                n = len(ids)
                fields.update({_stats_field(f): Pending(np.int64, (n,)) for f in _versions(plan)})
            else:
                fields = plan.apply(batch.fields, rng) if plan is not None else batch.fields
                for f, version in _versions(plan).items():
                    fields[_stats_field(f)] = np.full(len(ids), version, np.int64)
            if recipe.tokens is not None:  # a row per sequence: its last turn's
                tokens = collate_tokens(fields, ids, batch.groups, recipe.tokens)
                arrays = collate(tokens.rest)
                arrays.update(tokens.arrays)
                rows = tokens.rows
                ids, weights, source_index = ids[rows], weights[rows], source_index[rows]
                meta = {k: take_rows(v, rows) for k, v in meta.items()}
            else:
                arrays = collate(fields)
                if batch.groups is not None:
                    arrays.update(group_arrays(batch.groups))
            wire = to_wire(
                arrays,
                ids,
                weights=weights,
                source_index=source_index,
                sources=batch.sources,
                recipe_version=recipe.version,
                meta=meta,
                claim=batch.claim,
            )
            if wire.pending:
                assert plan is not None
                message = shm.deliver(
                    wire,
                    partial(_augment_into, plan, batch.fields, rng),
                    reader_host=entry.shm_host,
                )
            else:
                message = shm.to_message(wire, reader_host=entry.shm_host)
            seen.batch(time.perf_counter() - began, len(ids))
            seen.hit_rates(batch.sources, *hit_rates(reg.store, recipe.name))
            pushed = push(reg, recipe, message, counts, batch.claim)
            if pushed == "full":
                break
            if isinstance(pushed, str):  # stale or unregistered: the new fill reports state
                stale = pushed == "stale" and recipe.admission is not None and batch.groups
                if stale and batch.claim is None:  # (a claim is given back, not its slots)
                    taken = len(np.unique(batch.groups.trajectory))  # never served
                    admission.give_back(reg.store, taken, f"{recipe.name}: a stale batch")
                return {"made": made, "state": f"stopped: recipe {pushed}"}
            length, made, sampled, state = pushed, made + 1, sampled + rows, "ok"
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
    for name in reg.r.smembers(reg.rollouts_waiting_key):
        run_fill(reg, name.decode())  # its state recorded, an error logged once


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
        shm.reap_orphans(shm.ORPHAN_AGE_S)
        reap_unused()  # shared sampling indexes whose processes were all killed
    except OSError:
        log.warning("reaping orphaned shm segments failed", exc_info=True)


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
        for forget in (forget_namespace, forget_sessions, forget_store):
            forget(namespace)
    if str(result["state"]).startswith("error:"):  # FAILED in Flower, not a quiet success
        raise FillError(f"prefetch of {namespace}/{name} failed: {result['state'][7:]}")
    return result

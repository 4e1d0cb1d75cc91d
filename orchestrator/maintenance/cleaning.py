"""``claw.maintenance.clean``: bring each declared source's new steps into a namespace,
cleaned (beat, 10 s).

A source is a raw namespace in its own representation (another policy's logs, human
demonstrations: any field names, dtypes, action encoding). Its spec
(:class:`~orchestrator.transforms.cleaning.CleanSpec`, declared on the target with
:func:`define_source`) maps its steps to the target's representation and names the
rules a step must pass. Each tick reads the source's steps past the source's cursor (per
shard: the last id done), maps them, commits them into the target (with ``tags.source``
and the spec's tags; the batch id derives from the source ids, so a tick killed before
its cursor moved replays nothing twice), then quarantines the steps that failed a rule
(orchestrator/delivery/quarantine.py: curated ``trainable: false``, ``quality:
quarantine``, never a silent delete; counted by rule for ``claw stats``), and, with
``dedup``, the steps whose digest an earlier step of any source had (rule
``duplicate``). The steps that passed update the target's global normalisation
statistics (``claw:{ns}:nstats``: count, mean and variance per field, one atomic merge
per batch, shared by every worker; their ``count`` is the version a batch normalised
with them names) and the quartile samples its ``iqr`` outlier rules read.

Keys (``claw:{target}:``): ``clean`` (hash: source name -> spec JSON), ``clean:cursor``
(hash: ``<source>:<shard>`` -> last source id done), ``clean:counts`` (hash:
``<source>:steps`` -> steps brought in, ``<source>:<rule>`` -> steps quarantined by it),
``clean:lock:<source>`` (one tick at a time), ``clean:seen``, ``clean:seen:1`` and
``clean:seen:2`` (the dedup digests), ``nstats`` (the statistics, laid out as
:class:`~orchestrator.delivery.augstats.RedisStats` keeps them).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import tag_column
from claw_tasks.store import Store
from claw_tasks.worker.app import app
from orchestrator.delivery.augstats import namespace_stats
from orchestrator.delivery.quarantine import (
    QUARANTINE,
    batch_keys,
    clean_key,
    quarantine,
    quarantined,
    seen_before,
)
from orchestrator.maintenance.beat import each_namespace
from orchestrator.maintenance.lifecycle import synced_index
from orchestrator.transforms.cleaning import CleanSpec, map_fields, step_digests, violations
from orchestrator.transforms.quantiles import QuantileSample
from orchestrator.transforms.running import RunningStats

BATCH = 1024
LOCK_TTL_S = 120
TICK_BUDGET_S = 5.0
DUPLICATE = "duplicate"
__all__ = ["QUARANTINE", "clean_source", "define_source", "quarantined", "sources"]


def define_source(target: Store, name: str, spec: CleanSpec | Mapping[str, Any]) -> CleanSpec:
    """Declare a source of ``target``: the beat cleans its steps into it from now on."""
    spec = spec if isinstance(spec, CleanSpec) else CleanSpec.model_validate(dict(spec))
    target.r.hset(clean_key(target), name, spec.model_dump_json())
    return spec


def sources(target: Store) -> dict[str, CleanSpec]:
    raw = target.r.hgetall(clean_key(target))
    return {k.decode(): CleanSpec.model_validate(json.loads(v)) for k, v in sorted(raw.items())}


def clean_source(
    target: Store, name: str, spec: CleanSpec, budget_s: float = TICK_BUDGET_S
) -> dict[str, int]:
    """One tick of source ``name`` (under its lock: one tick at a time on any worker);
    returns steps brought in and quarantined."""
    lock = clean_key(target, f"lock:{name}")
    token = uuid.uuid4().hex
    if not target.r.set(lock, token, nx=True, ex=LOCK_TTL_S):
        return {"steps": 0, "quarantined": 0, "locked": 1}
    try:
        return _clean_source(target, name, spec, budget_s)
    finally:
        if target.r.get(lock) == token.encode():
            target.r.delete(lock)


def _clean_source(target: Store, name: str, spec: CleanSpec, budget_s: float) -> dict[str, int]:
    src = Store(target.r, spec.namespace)
    if not src.exists():
        return {"steps": 0, "quarantined": 0}
    index, _ = synced_index(src)
    schema = index.schema
    if schema is None:
        return {"steps": 0, "quarantined": 0}
    cursor_key = clean_key(target, "cursor")
    cursor = {k.decode(): int(v) for k, v in target.r.hgetall(cursor_key).items()}
    cols, cap = index.columns, index.cap
    deadline, brought, bad_total = time.monotonic() + budget_s, 0, 0
    for shard in range(index.n_shards):
        lo = cursor.get(f"{name}:{shard}", 0)
        part = slice(shard * cap, (shard + 1) * cap)
        ids = cols["id"][part][cols["alive"][part] & (cols["id"][part] > lo)]
        ids = np.sort(ids)
        for start in range(0, len(ids), BATCH):
            if time.monotonic() > deadline:
                break
            chunk = ids[start : start + BATCH]
            try:
                steps = src.get(chunk, fields=list(schema.fields))
            except KeyError:  # evicted since the sync: the next tick reads past them
                break
            bad_total += _bring(target, name, spec, steps, chunk, schema.fields)
            brought += len(chunk)
            target.r.hset(cursor_key, f"{name}:{shard}", int(chunk[-1]))
    return {"steps": brought, "quarantined": bad_total}


def _bring(
    target: Store,
    name: str,
    spec: CleanSpec,
    steps: dict[str, Any],
    ids: np.ndarray,
    field_names: Mapping[str, Any],
) -> int:
    """Commit one batch of a source's steps, cleaned; returns how many were quarantined."""
    fields = map_fields(spec, {f: steps[f] for f in field_names})
    nstats = namespace_stats(target)
    z = {o.field: nstats.get(o.field) for o in spec.outliers if o.iqr is None}
    samples = {o.field: nstats.get_sample(o.field) for o in spec.outliers if o.iqr is not None}
    found = violations(spec, fields, z, samples)
    n = len(ids)
    digest = hashlib.sha1(f"{name}:{spec.namespace}:{ids[0]}:{ids[-1]}:{n}".encode()).hexdigest()
    reward = np.nan_to_num(np.asarray(steps["reward"], np.float32))
    terminated = np.asarray(steps["terminated"], bool)
    batch = StepBatch(
        episode=StrColumn.of([f"{name}/{e}" for e in steps["episode_id"]]),
        step_index=np.asarray(steps["step_index"], np.int64),
        reward=reward,
        terminated=terminated,
        truncated=np.asarray(steps["truncated"], bool),
        fields=fields,
        batch_id=f"clean-{digest[:32]}",
    )
    batch.strs[tag_column("source")] = StrColumn.of([name] * n)
    for tag, value in spec.tags.items():
        batch.strs[tag_column(tag)] = StrColumn.of([value] * n)
    result = target.commit(batch)
    if result.replayed:  # a tick killed after its commit: counted and merged already
        return 0
    if spec.dedup is not None:  # after the commit: a replay never meets its own digests
        names = spec.dedup.fields or sorted(fields)
        cfg = target.config()
        window = spec.dedup.window or cfg.n_shards * cfg.cap
        digests = step_digests(fields, names, reward, terminated)
        found[DUPLICATE] = seen_before(target, digests, window)
    bad = quarantine(target, result.ids, found, name, {f"{name}:steps": n})
    good = ~bad
    if good.any():
        for fname, values in fields.items():
            if np.asarray(values).dtype.kind == "f":
                nstats.merge(fname, RunningStats.of(np.asarray(values)[good]))
        keys = batch_keys(ids, n)[good]
        for fname in sorted(samples):
            nstats.merge_sample(fname, QuantileSample.of(np.asarray(fields[fname])[good], keys))
    return int(bad.sum())


@app.task(name="claw.maintenance.clean", acks_late=False, ignore_result=True)
def clean() -> dict[str, Any]:
    """Clean every declared source into its namespace; raise (FAILED in Flower) on failures."""

    def work(target: Store) -> dict[str, Any] | None:
        if not target.r.exists(clean_key(target)):
            return None
        return {name: clean_source(target, name, s) for name, s in sources(target).items()}

    return each_namespace("cleaning", work)

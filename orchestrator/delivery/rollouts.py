"""On-policy delivery: the fill of a ``rollout`` recipe (docs/recipes.md, "On-policy").

The recipe's live param ``rollout.version_param`` (``policy_version``) is the target v;
``set_params`` moves it. A fill:

1. forms the rollout of v once: ``rollout.steps`` ready steps of policy versions
   ``v - max_lag .. v`` that no earlier rollout took (:mod:`orchestrator.sampling.rollouts`
   picks them), their advantages and returns computed here (GAE, or V-trace with the
   target policy's numbers from the recipe's scorer) and stored with their ids as the
   *plan*; while fewer are ready it records why and ends (the next commit looks again);
2. pushes the plan's minibatches ``k = 0 .. epochs * n - 1`` (n = steps / batch_size) in
   order: epoch ``k // n`` is a permutation of the rollout drawn from
   ``default_rng([seed, rollout, epoch])``, minibatch ``k % n`` its n-th slice, so every
   step is in exactly one minibatch of each epoch, whichever worker cuts it;
3. once all are pushed, waits for v to move: one rollout per target.

A fill pushing more than one epoch reads the rollout's steps once (up to
``READ_ONCE_BYTES``) and pushes its first minibatch alone, the others in one transaction.

No fill waits for steps: one that finds the rollout short records the recipe in the
namespace's set of waiting rollouts (``rowaiting``, :meth:`Registry.rollouts_waiting_key`)
and ends. Each ingest commit in the namespace then sweeps the waiting recipes in the
worker process that committed (``orchestrator.delivery.prefetch``, on the ingest task's
``committed`` signal), so the commit that completes a rollout forms and serves it at once
(no poll, no second task), and no pool process is held while the steps are still coming
(the ingest tasks that bring them need those processes). Forming removes the recipe from
the set in the same transaction.

Each sweep also counts *dropped-stale* steps: candidates of versions below the window that
no rollout took; they are never served.

State per recipe, in the namespace's keys (``claw:{ns}:``, :meth:`Registry.rollout_keys`):

- ``ro:<name>`` hash: ``no`` (rollouts formed so far; the current one's number),
  ``target`` (the v it serves), ``rv`` (the recipe version it is pushed for), ``cursor``
  (its minibatches pushed), ``total``, ``dropped_stale``, ``lost`` (steps of rollouts
  whose steps were overwritten before they were served), ``waiting_since``;
- ``ro:<name>:plan``: the current rollout (msgpack: ids in chain order, advantages,
  returns, the behaviour's log-probs and values, versions, seed);
- ``ro:<name>:seen``: the ids every rollout took or a sweep counted stale (sorted int64;
  pruned to live steps at each formation), so that no step is taken or counted twice.

Formation and the sweep are transactions watching the hash, ``seen`` and the recipe's
version (a sweep that began before the version moved forms nothing); minibatches
``k .. k + m - 1`` are pushed in a transaction that checks the cursor is still ``k`` and
advances it by ``m``, so workers
that race, or a worker killed between its read and its push, never skip nor duplicate a
minibatch. A recipe version change under the same target (``set_params`` of another
param, or of the same v: how a learner asks for the rollout again) drops the queued
minibatches (as for every recipe) and serves the rollout again from its first minibatch.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from claw_tasks.format.arrays import pack_array, packb, unpack_array, unpackb
from claw_tasks.settings import get_settings
from orchestrator.delivery import shm
from orchestrator.delivery.collate import collate
from orchestrator.delivery.registry import Entry, Registry
from orchestrator.delivery.wire import to_wire
from orchestrator.recipe.model import Recipe, Rollout
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.rollouts import Chained
from orchestrator.sampling.sample import read_steps, select_rollout
from orchestrator.transforms.advantages import Estimate, gae, normalize, vtrace
from orchestrator.transforms.augment import AugmentPlan

READ_ONCE_BYTES = 256 << 20
"""A fill pushing more than one epoch reads a rollout of at most this many payload bytes
once and cuts its minibatches from it (a read per minibatch otherwise)."""

Scorer = Callable[[dict[str, np.ndarray], dict[str, Any]], dict[str, np.ndarray]]
"""``scorer(fields, params)`` for V-trace: given a rollout's steps (the recipe's fields,
``next_obs`` and ``policy_version``) and the recipe's params (the target version
included), the target policy's ``log_prob``, ``value`` and ``next_value`` (V(next_obs))
per step."""


def load_scorer(name: str) -> Scorer:
    """The scorer ``module:function``, if the workers' allowlist (``CLAW_SCORERS``, the
    one the priority scorers use) names it."""
    allowed = get_settings().scorers
    if name not in allowed:
        raise ValueError(
            f"scorer {name!r} is not allowed on this worker: add it to CLAW_SCORERS "
            f"(now {', '.join(allowed) or 'empty'})"
        )
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


@functools.lru_cache(maxsize=4)
def permutation(seed: int, no: int, epoch: int, n: int) -> np.ndarray:
    """Epoch ``epoch`` of rollout ``no`` (of ``n`` steps, seeded ``seed``: the plan's and
    every minibatch's ``meta["rollout"]``) as positions in the rollout's chain order;
    minibatch j of that epoch is its j-th slice. Cached while a fill cuts an epoch."""
    perm = np.random.default_rng([seed, no, epoch]).permutation(n)
    perm.flags.writeable = False
    return perm


@dataclass(frozen=True)
class Plan:
    """A formed rollout: its steps in chain order and what each minibatch adds to them."""

    no: int
    target: int
    seed: int
    epochs: int
    batch_size: int
    ids: np.ndarray  # int64
    advantages: np.ndarray  # float32
    returns: np.ndarray  # float32
    log_prob: np.ndarray  # float32: the behaviour policy's
    value: np.ndarray  # float32: the behaviour critic's
    version: np.ndarray  # int32: each step's policy_version

    @property
    def per_epoch(self) -> int:
        return len(self.ids) // self.batch_size

    @property
    def total(self) -> int:
        return self.epochs * self.per_epoch

    def minibatch(self, k: int) -> np.ndarray:
        """Positions of minibatch ``k``: a slice of its epoch's permutation."""
        epoch, j = divmod(k, self.per_epoch)
        perm = permutation(self.seed, self.no, epoch, len(self.ids))
        return perm[j * self.batch_size : (j + 1) * self.batch_size]

    _ARRAYS = ("ids", "advantages", "returns", "log_prob", "value", "version")

    def to_bytes(self) -> bytes:
        head = {k: getattr(self, k) for k in ("no", "target", "seed", "epochs", "batch_size")}
        return packb({**head, **{k: pack_array(getattr(self, k)) for k in self._ARRAYS}})

    @classmethod
    def from_bytes(cls, raw: bytes) -> Plan:
        d = unpackb(raw)
        return cls(**{k: unpack_array(v) if k in cls._ARRAYS else int(v) for k, v in d.items()})


@dataclass(frozen=True)
class State:
    """``ro:<name>``, decoded (see the module docstring)."""

    no: int
    target: int | None
    rv: int
    cursor: int
    total: int
    dropped_stale: int
    lost: int
    waiting_since: float | None

    @classmethod
    def of(cls, raw: dict[bytes, bytes]) -> State:
        def num(k: str, default: float | None = 0) -> Any:
            v = raw.get(k.encode())
            return default if v is None else float(v)

        target = num("target", None)
        return cls(
            int(num("no")),
            None if target is None else int(target),
            int(num("rv")),
            int(num("cursor")),
            int(num("total")),
            int(num("dropped_stale")),
            int(num("lost")),
            num("waiting_since", None),
        )

    def describe(self) -> dict[str, Any]:
        """What ``BatchClient.stats`` and ``claw recipes`` show."""
        return {
            "rollouts": self.no,
            "policy_version": self.target,
            "minibatches_pushed": self.cursor,
            "minibatches": self.total,
            "dropped_stale": self.dropped_stale,
            "lost": self.lost,
        }


def read_state(reg: Registry, name: str) -> State:
    return State.of(reg.r.hgetall(reg.rollout_keys(name)[0]))


Target = tuple[np.ndarray, np.ndarray, np.ndarray]
"""The target policy's log-probs, values and next values per step (V-trace)."""


def estimate(chained: Chained, ro: Rollout, gamma: float, target: Target | None) -> Estimate:
    """The rollout's advantages and returns (normalised per rollout when asked)."""
    c = chained
    if ro.advantage == "gae":
        est = gae(c.reward, c.value, c.next_value, c.terminated, c.chain_end, gamma, ro.gae_lambda)
    else:
        pi, v, nv = (c.log_prob, c.value, c.next_value) if target is None else target
        est = vtrace(
            c.log_prob,
            pi,
            c.reward,
            v,
            nv,
            c.terminated,
            c.chain_end,
            gamma,
            ro.rho_bar,
            ro.c_bar,
            ro.gae_lambda,
        )
    if ro.normalize:
        est = est._replace(advantages=normalize(est.advantages))
    return est


def score(reg: Registry, recipe: Recipe, chained: Chained) -> Target | None:
    """The scorer's numbers for a V-trace rollout holding steps of older versions; None
    when every step is of the target version (its recorded numbers are the target's)."""
    ro = recipe.rollout
    assert ro is not None
    target = int(recipe.params[ro.version_param])
    if ro.advantage != "vtrace" or ro.scorer is None or (chained.version == target).all():
        return None
    fields = [f for f in recipe.fields if f != "policy_version"]
    batch = read_steps(reg.store, recipe, chained.ids, [*fields, "next_obs"])
    if batch is None:
        raise RuntimeError("steps of the rollout were overwritten while it was scored")
    given = {**batch.fields, "policy_version": chained.version}
    out = load_scorer(ro.scorer)(given, dict(recipe.params))
    n = len(chained.ids)
    try:
        got = tuple(
            np.asarray(out[k], np.float64).reshape(n) for k in ("log_prob", "value", "next_value")
        )
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"scorer {ro.scorer}: must return log_prob, value, next_value of {n} steps ({e})"
        ) from None
    if not all(np.isfinite(a).all() for a in got):
        raise ValueError(f"scorer {ro.scorer}: returned non-finite numbers")
    return got  # type: ignore[return-value]


FORMED = "formed by another fill"
"""What a sweep asked to form returns when the rollout of its target was formed meanwhile."""


def _sweep(reg: Registry, recipe: Recipe, target: int, form: bool) -> Plan | str:
    """Count the new stale steps and, when ``form`` and enough are ready, form the rollout
    of ``target``: one transaction. Returns the plan, :data:`FORMED`, or the state of the
    wait."""
    ro = recipe.rollout
    assert ro is not None
    name = recipe.name
    skey, pkey, seen = reg.rollout_keys(name)
    window = (target - ro.max_lag, target)
    with reg.r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(skey, seen, reg.versions_key)
                if int(pipe.hget(reg.versions_key, name) or 0) != recipe.version:
                    pipe.unwatch()  # moved on while this fill waited: the next fill forms
                    return "stopped: recipe changed"
                st = State.of(pipe.hgetall(skey))
                if form and st.no and st.target == target:
                    pipe.unwatch()  # formed meanwhile (a commit, another fill): serve it
                    return FORMED
                classified = np.frombuffer(pipe.get(seen) or b"", np.int64)
                sel = select_rollout(reg.store, recipe, classified, window)
                taken = sel.taken if form else None
                now = time.time()
                if taken is None and not len(sel.stale):
                    pipe.unwatch()
                    if form and st.waiting_since is None:
                        reg.r.hsetnx(skey, "waiting_since", now)
                    return _waiting(recipe, target, sel.ready, sel.waiting, st, now)
                plan = None
                if taken is not None:
                    est = estimate(taken, ro, recipe.gamma, score(reg, recipe, taken))
                    seed = (
                        recipe.seed
                        if recipe.seed is not None
                        else int(np.random.SeedSequence().entropy % 2**63)
                    )
                    plan = Plan(
                        st.no + 1,
                        target,
                        seed,
                        ro.epochs,
                        recipe.batch_size,
                        taken.ids,
                        est.advantages.astype(np.float32),
                        est.returns.astype(np.float32),
                        taken.log_prob.astype(np.float32),
                        taken.value.astype(np.float32),
                        taken.version,
                    )
                    keep = [sel.alive, sel.stale, taken.ids]
                else:
                    keep = [classified, sel.stale]
                pipe.multi()
                pipe.set(seen, np.unique(np.concatenate(keep)).astype(np.int64).tobytes())
                if len(sel.stale):
                    pipe.hincrby(skey, "dropped_stale", len(sel.stale))
                if plan is not None:
                    pipe.set(pkey, plan.to_bytes())
                    fields = {"no": plan.no, "target": target, "rv": recipe.version}
                    pipe.hset(skey, mapping={**fields, "cursor": 0, "total": plan.total})
                    pipe.hdel(skey, "waiting_since")
                    pipe.srem(reg.rollouts_waiting_key, name)
                pipe.execute()
                if plan is not None:
                    return plan
                return _waiting(recipe, target, sel.ready, sel.waiting, st, now)
            except redis.WatchError:
                continue


def _waiting(recipe: Recipe, target: int, ready: int, waiting: int, st: State, now: float) -> str:
    ro = recipe.rollout
    assert ro is not None
    if st.target == target and st.cursor >= st.total and st.no:
        return (
            f"rollout {st.no} of {ro.version_param} {target} served ({st.total} minibatches); "
            f"waiting for {ro.version_param} to move (set_params)"
        )
    since = "" if st.waiting_since is None else f" for {now - st.waiting_since:.1f} s"
    versions = str(target) if ro.max_lag == 0 else f"{target - ro.max_lag}..{target}"
    more = f", {waiting} more waiting for their next value" if waiting else ""
    return (
        f"waiting for rollout of {ro.version_param} {versions}: {ready} of {ro.steps} steps "
        f"ready{more}{since}"
    )


def _push(
    reg: Registry, recipe: Recipe, plan: Plan, k: int, items: list[bytes]
) -> int | str | None:
    """Push minibatches ``k .. k + len(items) - 1`` of ``plan`` if the cursor is still
    ``k``, in one transaction; returns the queue length, ``"stale"``/``"unregistered"``
    (taken back), or None (another fill pushed them, or the rollout moved on)."""
    name, skey = recipe.name, reg.rollout_keys(recipe.name)[0]
    queue, counters, m = reg.queue(name), reg.counters(name), len(items)
    with reg.r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(skey)
                no, cursor = pipe.hmget(skey, ["no", "cursor"])
                if int(no or 0) != plan.no or int(cursor or 0) != k:
                    pipe.unwatch()
                    return None
                pipe.multi()
                pipe.rpush(queue, *items)
                pipe.hget(reg.versions_key, name)
                pipe.exists(reg.recipe_key(name))
                pipe.hincrby(skey, "cursor", m)
                pipe.hincrby(counters, "produced", m)
                pipe.hincrby(counters, "sampled", recipe.batch_size * m)
                length, version, registered = pipe.execute()[:3]
                break
            except redis.WatchError:
                continue  # the hash changed (another field, or the cursor): look again
    if registered and (version is None or int(version) == recipe.version):
        return int(length)
    with reg.r.pipeline(transaction=False) as pipe:
        for item in items:
            pipe.lrem(queue, -1, item)
        pipe.execute()
    for item in items:
        shm.discard(item)
    return "stale" if registered else "unregistered"


def _message(
    reg: Registry,
    entry: Entry,
    augment: AugmentPlan | None,
    plan: Plan,
    k: int,
    whole: Batch | None,
) -> bytes | None:
    """Minibatch ``k`` as a queue item (cut from ``whole`` when given, else read); None
    when one of its steps is no longer stored."""
    recipe = entry.recipe
    pos = plan.minibatch(k)
    batch = whole.take(pos) if whole is not None else read_steps(reg.store, recipe, plan.ids[pos])
    if batch is None:
        return None
    rng = np.random.default_rng([plan.seed, plan.no, k, 1])
    fields = augment.apply(batch.fields, rng) if augment is not None else batch.fields
    arrays, meta = collate(fields), dict(batch.meta)
    arrays.update(
        advantages=plan.advantages[pos],
        returns=plan.returns[pos],
        log_prob=plan.log_prob[pos],
        value=plan.value[pos],
        policy_version=plan.version[pos],
    )
    epoch, j = divmod(k, plan.per_epoch)
    meta["rollout"] = {
        "no": plan.no,
        "policy_version": plan.target,
        "epoch": epoch,
        "minibatch": j,
        "epochs": plan.epochs,
        "minibatches": plan.per_epoch,
        "steps": len(plan.ids),
        "seed": plan.seed,
    }
    wire = to_wire(
        arrays, batch.ids, sources=batch.sources, recipe_version=recipe.version, meta=meta
    )
    return shm.to_message(wire, reader_host=entry.shm_host)


def _serve(
    reg: Registry, entry: Entry, augment: AugmentPlan | None, plan: Plan, k: int
) -> tuple[int, str]:
    """Push the plan's minibatches from ``k`` while the queue has room: the first alone
    (the learner waits for it), the rest in one transaction (a round trip or three per
    minibatch would be most of a small rollout's fill)."""
    recipe = entry.recipe
    ro = recipe.rollout
    assert ro is not None
    name, made, depth = recipe.name, 0, recipe.prefetch.depth
    length = int(reg.r.llen(reg.queue(name)))
    whole: Batch | None = None  # the rollout's stored fields, when read once for this fill
    if _read_once(reg, recipe, plan, k, length):
        whole = read_steps(reg.store, recipe, plan.ids)
        if whole is None:
            return made, _lost(reg, recipe, plan)
    while k < plan.total and length < depth:
        group = 1 if made == 0 else min(plan.total - k, depth - length)
        items = []
        for i in range(group):
            item = _message(reg, entry, augment, plan, k + i, whole)
            if item is None:
                for done in items:
                    shm.discard(done)
                return made, _lost(reg, recipe, plan)
            items.append(item)
        pushed = _push(reg, recipe, plan, k, items)
        if pushed is None:
            for done in items:
                shm.discard(done)
            break
        if isinstance(pushed, str):
            return made, f"stopped: recipe {pushed}"
        length, k, made = pushed, k + group, made + group
    return made, (
        f"rollout {plan.no} of {ro.version_param} {plan.target}: {k} of {plan.total} "
        "minibatches pushed"
    )


def _read_once(reg: Registry, recipe: Recipe, plan: Plan, k: int, length: int) -> bool:
    """Whether this fill reads the whole rollout once and cuts its minibatches from it:
    when it will push more minibatches than the rollout has (a read per minibatch would
    read the rollout more than once) and the rollout's payload is at most
    ``READ_ONCE_BYTES``."""
    pushes = min(plan.total - k, recipe.prefetch.depth - length)
    if pushes <= plan.per_epoch:
        return False
    schema = reg.store.schema()
    row = sum(
        spec.row_bytes
        for name, spec in (schema.fields.items() if schema is not None else ())
        if name in recipe.fields or (name == "obs" and "next_obs" in recipe.fields)
    )
    return row * len(plan.ids) <= READ_ONCE_BYTES


def _lost(reg: Registry, recipe: Recipe, plan: Plan) -> str:
    """Steps of the rollout were overwritten before they were served: it ends here."""
    skey = reg.rollout_keys(recipe.name)[0]
    with reg.r.pipeline(transaction=True) as pipe:
        pipe.hset(skey, "cursor", plan.total)
        pipe.hincrby(skey, "lost", len(plan.ids))
        pipe.execute()
    return (
        f"error: rollout {plan.no}: steps were overwritten before they were served; the "
        "namespace's capacity is too small for a rollout (raise it)"
    )


def run(reg: Registry, entry: Entry, augment: AugmentPlan | None) -> tuple[int, str]:
    """One fill of a rollout recipe: (minibatches pushed, state)."""
    recipe = entry.recipe
    ro = recipe.rollout
    assert ro is not None
    name = recipe.name
    target = int(recipe.params[ro.version_param])
    st = read_state(reg, name)
    if st.target is not None and target < st.target:
        return 0, (
            f"error: {ro.version_param} moved back from {st.target} to {target}: a rollout "
            "recipe's version only grows (unregister the recipe to start over)"
        )
    if st.no and st.target == target:
        if st.rv != recipe.version:  # queued minibatches were dropped: serve it again
            reg.r.hset(reg.rollout_keys(name)[0], mapping={"rv": recipe.version, "cursor": 0})
            st = read_state(reg, name)
        if st.cursor < st.total:
            raw = reg.r.get(reg.rollout_keys(name)[1])
            if raw is not None:
                return _serve(reg, entry, augment, Plan.from_bytes(raw), st.cursor)
        got = _sweep(reg, recipe, target, form=False)
        return 0, str(got)
    # Before the sweep: a commit from now on forms the rollout if this sweep finds it short
    # (prefetch's commit hook), so no fill waits for steps, and none is lost between them.
    reg.r.sadd(reg.rollouts_waiting_key, name)
    got = _sweep(reg, recipe, target, form=True)
    if got is FORMED:  # by a commit or another fill since this one read the state
        return run(reg, entry, augment)  # serves it from its cursor
    if isinstance(got, str):
        return 0, got
    return _serve(reg, entry, augment, got, 0)

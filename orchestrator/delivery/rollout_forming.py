"""Forming a ``rollout`` recipe's rollout (:mod:`orchestrator.delivery.rollouts`): the
sweep that counts stale steps and, once enough are ready, takes them as the plan, with
their advantages and returns (GAE, or V-trace with the target policy's numbers from the
recipe's scorer)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from claw_tasks.settings import get_settings
from orchestrator.delivery.registry import Registry
from orchestrator.delivery.rollout_state import Plan, State
from orchestrator.recipe.model import Recipe, Rollout
from orchestrator.sampling.rollouts import Chained
from orchestrator.sampling.sample import read_steps, select_rollout
from orchestrator.transforms.advantages import Estimate, gae, normalize, vtrace

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
    return got  # type: ignore[return-value]  # three float64 arrays (a tuple of a generator)


FORMED = "formed by another fill"
"""What a sweep asked to form returns when the rollout of its target was formed meanwhile."""


def sweep(reg: Registry, recipe: Recipe, target: int, form: bool) -> Plan | str:
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
                if taken is not None and not _finite32(est.advantages, est.returns):
                    # each input is finite in float32; their sums overflowed it: never
                    # served, counted with the stale steps
                    sel = sel._replace(stale=np.concatenate([sel.stale, taken.ids]))
                    taken = None
                if taken is not None:
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


def _finite32(*arrays: np.ndarray) -> bool:
    """Whether every value is finite once cast to float32 (what a minibatch carries)."""
    with np.errstate(over="ignore"):
        return all(bool(np.isfinite(a.astype(np.float32)).all()) for a in arrays)

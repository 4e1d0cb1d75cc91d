"""On-policy delivery: the fill of a ``rollout`` recipe (docs/recipes.md, "On-policy").

The recipe's live param ``rollout.version_param`` (``policy_version``) is the target v;
``set_params`` moves it. A fill:

1. forms the rollout of v once: ``rollout.steps`` ready steps of policy versions
   ``v - max_lag .. v`` that no earlier rollout took (:mod:`orchestrator.sampling.rollouts`
   picks them), their advantages and returns computed here (GAE, or V-trace with the
   target policy's numbers from the recipe's scorer) and stored with their ids as the
   *plan*; while fewer are ready it records why and ends (the next commit looks again);
2. pushes the plan's minibatches ``k = 0 .. epochs * n - 1`` (n = steps / batch_size) in
   order: epoch ``k // n`` is the (``k // n`` + 1)-th permutation of the rollout drawn
   from ``default_rng([seed, rollout])`` (``rollout_state.EpochOrders``), minibatch
   ``k % n`` its n-th slice, so every step is in exactly one minibatch of each epoch,
   whichever worker cuts it;
3. once all are pushed, waits for v to move: one rollout per target.

A fill pushing more than one epoch reads the rollout's steps once (up to
``rollout_serving.READ_ONCE_BYTES``) and pushes its first minibatch alone, the others in
one transaction.

The rollout's data and state are in :mod:`~orchestrator.delivery.rollout_state`, forming
it in :mod:`~orchestrator.delivery.rollout_forming`, serving it in
:mod:`~orchestrator.delivery.rollout_serving`; this module is the fill that runs both.

No fill waits for steps: one that finds the rollout short records the recipe in the
namespace's set of waiting rollouts (``rowaiting``, :meth:`Registry.rollouts_waiting_key`)
and ends. Each ingest commit in the namespace then sweeps the waiting recipes in the
worker process that committed (``orchestrator.delivery.prefetch``, on the ingest task's
``committed`` signal), so the commit that completes a rollout forms and serves it at once
(no poll, no second task), and no pool process is held while the steps are still coming
(the ingest tasks that bring them need those processes). Forming removes the recipe from
the set in the same transaction. A learner that commits a rollout's last steps in its own
process (with the ingest task's code: ``ClawRolloutBuffer(form_here=True)``, an opt-in)
runs the same sweep there next, :func:`form`: no broker hop nor worker task between its
last steps and its rollout.

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

import logging

from claw_tasks.store import NamespaceError
from orchestrator.delivery.registry import Entry, Registry
from orchestrator.delivery.rollout_forming import FORMED, sweep
from orchestrator.delivery.rollout_serving import serve
from orchestrator.delivery.rollout_state import Plan, permutation, read_state
from orchestrator.transforms.augment import AugmentPlan

# permutation: the documented path of the epochs' order
__all__ = ["form", "permutation", "run", "waiting"]

log = logging.getLogger(__name__)


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
                return serve(reg, entry, augment, Plan.from_bytes(raw), st.cursor)
        got = sweep(reg, recipe, target, form=False)
        return 0, str(got)
    # Before the sweep: a commit from now on forms the rollout if this sweep finds it short
    # (prefetch's commit hook), so no fill waits for steps, and none is lost between them.
    reg.r.sadd(reg.rollouts_waiting_key, name)
    got = sweep(reg, recipe, target, form=True)
    if got is FORMED:  # by a commit or another fill since this one read the state
        return run(reg, entry, augment)  # serves it from its cursor
    if isinstance(got, str):
        return 0, got
    return serve(reg, entry, augment, got, 0, formed=True)


def waiting(reg: Registry) -> list[str]:
    """The namespace's rollout recipes waiting for steps (what a commit hook sweeps)."""
    return sorted(n.decode() for n in reg.r.smembers(reg.rollouts_waiting_key))


def form(reg: Registry, name: str) -> tuple[int, str] | None:
    """What an ingest worker's commit hook does for rollout recipe ``name``, in this
    process: one fill (:func:`run`), which forms and serves the rollout if the steps
    committed so far complete it. For a learner that committed its rollout's last steps
    itself. Returns (minibatches pushed, state), the state to be recorded as a fill's
    (``reg.bump(name, state=state)``); None for a recipe that is not a rollout recipe or
    augments its steps (the workers' fill builds the augmentation: left to them). A
    failure is the state (``error: ...``), logged, never raised: the rollout then waits
    for the workers' next fill, as after a failed commit hook."""
    entry = reg.get(name)
    if entry is None:
        return 0, "unregistered"
    if entry.recipe.rollout is None or entry.recipe.augment:
        return None
    try:
        return run(reg, entry, None)
    except NamespaceError as e:
        return 0, f"insufficient data: {e}"
    except Exception as e:  # recorded as a fill's state; the workers' next fill tries again
        log.exception("forming rollout %s/%s failed", reg.ns, name)
        return 0, f"error: {type(e).__name__}: {e}"

"""Serving a formed rollout (:mod:`orchestrator.delivery.rollouts`): its minibatches cut,
augmented and pushed in order, each push one script call that checks and advances the
cursor."""

from __future__ import annotations

import numpy as np

from orchestrator.delivery import shm
from orchestrator.delivery.collate import collate
from orchestrator.delivery.registry import Entry, Registry
from orchestrator.delivery.rollout_state import Plan
from orchestrator.delivery.wire import to_wire
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.sample import read_steps
from orchestrator.transforms.augment import AugmentPlan

READ_ONCE_BYTES = 256 << 20
"""A fill pushing more than one epoch reads a rollout of at most this many payload bytes
once and cuts its minibatches from it (a read per minibatch otherwise)."""


def _push(
    reg: Registry, recipe: Recipe, plan: Plan, k: int, items: list[bytes]
) -> int | str | None:
    """Push minibatches ``k .. k + len(items) - 1`` of ``plan`` if the cursor is still
    ``k``, in one script call (:meth:`Registry.push_rollout`); returns the queue length,
    ``"stale"``/``"unregistered"`` (taken back), or None (another fill pushed them, or
    the rollout moved on)."""
    name, queue = recipe.name, reg.queue(recipe.name)
    got = reg.push_rollout(name, plan.no, k, recipe.batch_size, items)
    if got is None:
        return None
    length, version, registered = got
    if registered and (version is None or version == recipe.version):
        return length
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
    held: bool = False,
) -> bytes | None:
    """Minibatch ``k`` as a queue item (cut from ``whole`` when given, else read:
    ``held`` as :func:`read_steps` takes it); None when one of its steps is no longer
    stored."""
    recipe = entry.recipe
    pos = plan.minibatch(k)
    batch = (
        whole.take(pos)
        if whole is not None
        else read_steps(reg.store, recipe, plan.ids[pos], held=held)
    )
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


def serve(
    reg: Registry,
    entry: Entry,
    augment: AugmentPlan | None,
    plan: Plan,
    k: int,
    formed: bool = False,
) -> tuple[int, str]:
    """Push the plan's minibatches from ``k`` while the queue has room: the first alone
    (the learner waits for it), the rest in one transaction (a round trip or three per
    minibatch would be most of a small rollout's fill). ``formed``: this fill has just
    formed the plan (its sweep synced the index): the first read needs no sync of its
    own (:func:`read_steps`' ``held``)."""
    recipe = entry.recipe
    ro = recipe.rollout
    assert ro is not None
    name, made, depth = recipe.name, 0, recipe.prefetch.depth
    length = int(reg.r.llen(reg.queue(name)))
    whole: Batch | None = None  # the rollout's stored fields, when read once for this fill
    if _read_once(reg, recipe, plan, k, length):
        whole = read_steps(reg.store, recipe, plan.ids, held=formed)
        if whole is None:
            return made, _lost(reg, recipe, plan)
    while k < plan.total and length < depth:
        group = 1 if made == 0 else min(plan.total - k, depth - length)
        items = []
        for i in range(group):
            item = _message(reg, entry, augment, plan, k + i, whole, formed and not made)
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

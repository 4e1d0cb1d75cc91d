"""What a batch dropped unserved (a recipe's new version drained it, or a pop found it
stale) gives back: a ``once`` batch its groups' claims, drawn again in the pass (with
``admission``, its trajectories back among the rewarded, unserved ones, to be served or
to lapse); another batch of an ``admission`` recipe the slots its trajectories took."""

from __future__ import annotations

import contextlib

from claw_tasks.store import Store
from orchestrator.delivery import admission, shm
from orchestrator.recipe.model import Recipe
from orchestrator.sampling import groups
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.groups import Claim


def drop(store: Store, recipe: Recipe, items: list[bytes]) -> None:
    """Discard queued batches of ``recipe`` and give back what they held."""
    slots, claims = 0, []
    for item in items:
        if recipe.admission is not None or recipe.grouped:
            with contextlib.suppress(Exception):  # unreadable: nothing to give back
                slots += unserved(shm.from_message(item), claims)
        shm.discard(item)
    give_back(store, recipe, slots, claims, "batches dropped")


def unserved(batch: Batch, claims: list[Claim]) -> int:
    """A batch dropped unserved: its claim is added to ``claims``; else the slots its
    trajectories took (0 for batches that are not group batches)."""
    if batch.claim is not None:
        claims.append(batch.claim)
        return 0
    return admission.trajectories_in(batch)


def give_back(store: Store, recipe: Recipe, slots: int, claims: list[Claim], why: str) -> None:
    if claims:
        groups.release(store, recipe.name, claims)
        if recipe.admission is not None:  # their trajectories wait to be served again
            admission.unclaimed(store, [c.token for c in claims])
    if slots and recipe.admission is not None:
        admission.give_back(store, slots, f"{recipe.name}: {why}")

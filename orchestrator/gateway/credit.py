"""Turn-level credit settings of a namespace, shared by every gateway process: the discount
gamma a reward is propagated back over a trajectory's turns with (``r[t] += gamma *
r[t + 1]``, :func:`claw_tasks.format.turns.discount_turns`), kept in the namespace's
``gwconf`` hash so that every gateway applies the same one (docs/llm.md, "Credit")."""

from __future__ import annotations

import math

from claw_tasks.store import Store


def conf_key(store: Store) -> str:
    return store.owned_key("gwconf")


def set_discount(store: Store, gamma: float | None) -> None:
    """Set the namespace's turn discount (None: none, rewards stay where they were put)."""
    if gamma is None:
        store.r.hdel(conf_key(store), "discount")
        return
    if isinstance(gamma, bool) or not math.isfinite(gamma) or not 0.0 <= gamma <= 1.0:
        raise ValueError(f"turn discount {gamma!r} must be a number in [0, 1]")
    store.r.hset(conf_key(store), "discount", repr(float(gamma)))


def discount(store: Store) -> float | None:
    """The namespace's turn discount, or None."""
    raw = store.r.hget(conf_key(store), "discount")
    return None if raw is None else float(raw)

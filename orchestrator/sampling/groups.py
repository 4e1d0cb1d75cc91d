"""A group batch's structure (:class:`Groups`) and the claims of ``once`` recipes: what
the ``group`` sampler (:mod:`orchestrator.sampling.samplers.group`) returns and reads, and
what delivery (token batches, the recipe registry) uses of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from claw_tasks.store import Store
from claw_tasks.store.scripts import Lua, execute

PASS_FIELD = "~pass"
"""Field of the claims hash holding the current pass (group ids cannot start with ``~``)."""


def claims_key(store: Store, recipe: str) -> str:
    """Hash of a ``once`` recipe's claims (a key ``store`` owns): group id -> the pass
    it was delivered in."""
    return store.owned_key(f"claims:{recipe}")


def _pass_of(mark: bytes) -> int:
    """The pass of a claim's mark (``<pass>:<batch token>``; a bare ``<pass>`` before)."""
    return int(mark.split(b":", 1)[0])


class Claims(NamedTuple):
    """The current pass of a ``once`` recipe and the groups delivered in it."""

    pass_no: int
    claimed: frozenset[str]

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> Claims:
        pass_no = int(raw.get(PASS_FIELD.encode(), 0))
        done = frozenset(k.decode() for k, v in raw.items() if _pass_of(v) == pass_no)
        return cls(pass_no, done - {PASS_FIELD})


class Claim(NamedTuple):
    """What one ``once`` batch claimed: its pass, its token (the claims' mark is
    ``<pass>:<token>``) and its group ids. A popped batch carries it
    (``Batch.claim``), so a batch dropped unserved can give its groups back."""

    pass_no: int
    token: str
    ids: tuple[str, ...]

    @property
    def mark(self) -> str:
        return f"{self.pass_no}:{self.token}"


_UNCLAIM = Lua("unclaim", "orchestrator")


def release(store: Store, recipe: str, claims: Sequence[Claim]) -> int:
    """Give back the groups of ``once`` batches dropped unserved (one round trip): they are
    drawn again in the same pass. Only claims still marked by those batches go, so calling
    it twice for one batch releases nothing the second time. Returns the groups released."""
    claims = [c for c in claims if c.ids]
    if not claims:
        return 0
    key = claims_key(store, recipe)

    def queue(pipe: Any) -> None:
        for c in claims:
            _UNCLAIM.queue(pipe, [key], [c.mark, *c.ids])

    got = execute(store.r, [_UNCLAIM], queue)
    return sum(int(n) for n in got)


class Groups(NamedTuple):
    """A batch's group structure, per drawn row (rows of a group and of a trajectory are
    contiguous, groups in draw order)."""

    group: np.ndarray  # int32: the row's group, numbered in the batch from 0
    trajectory: np.ndarray  # int32: the row's trajectory, numbered in the batch from 0
    returns: np.ndarray  # float32: its trajectory's return
    ids: tuple[str, ...]  # per group: its id (what once-claims record)
    pass_no: int  # the pass the groups were drawn for (once); 0 otherwise
    stale: tuple[str, ...] = ()  # claims of groups no longer present: to be pruned

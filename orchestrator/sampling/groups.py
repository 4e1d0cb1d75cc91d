"""A group batch's structure (:class:`Groups`) and the claims of ``once`` recipes: what
the ``group`` sampler (:mod:`orchestrator.sampling.samplers.group`) returns and reads, and
what delivery (token batches, the recipe registry) uses of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

PASS_FIELD = "~pass"
"""Field of the claims hash holding the current pass (group ids cannot start with ``~``)."""


def claims_key(base: str, recipe: str) -> str:
    """Hash of a ``once`` recipe's claims: group id -> the pass it was delivered in."""
    return f"{base}claims:{recipe}"


class Claims(NamedTuple):
    """The current pass of a ``once`` recipe and the groups delivered in it."""

    pass_no: int
    claimed: frozenset[str]

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> Claims:
        pass_no = int(raw.get(PASS_FIELD.encode(), 0))
        done = frozenset(k.decode() for k, v in raw.items() if int(v) == pass_no)
        return cls(pass_no, done - {PASS_FIELD})


class Groups(NamedTuple):
    """A batch's group structure, per drawn row (rows of a group and of a trajectory are
    contiguous, groups in draw order)."""

    group: np.ndarray  # int32: the row's group, numbered in the batch from 0
    trajectory: np.ndarray  # int32: the row's trajectory, numbered in the batch from 0
    returns: np.ndarray  # float32: its trajectory's return
    ids: tuple[str, ...]  # per group: its id (what once-claims record)
    pass_no: int  # the pass the groups were drawn for (once); 0 otherwise
    stale: tuple[str, ...] = ()  # claims of groups no longer present: to be pruned

"""What a sampler is: the contract every ``sampler.kind`` meets, and the registry.

A :class:`Sampler` serves one recipe source. It is given the namespace's metadata columns
(:data:`~orchestrator.sampling.candidates.Columns`, one array per column over the global
rows) and keeps its candidates (alive, trainable, matching the source's ``where``) and
whatever it draws from (sum trees, a group table) current from the rows whose metadata
changed: :meth:`Sampler.refresh` is its ``extend``/``update_priority`` in TorchRL's terms
(inserts, priorities, evictions and curation all arrive as changed rows, from the index's
change logs), :meth:`Sampler.invalidate` its reset. :meth:`Sampler.draw` returns a
:class:`Part`. A sampler's state is derived from the columns alone, so there is nothing
to save: a new process rebuilds it on its first draw.

:func:`register` adds a class under its spec's ``kind`` to :data:`SAMPLERS` and the
spec to the recipe's :data:`~orchestrator.recipe.model.SAMPLER_KINDS`, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from claw_tasks.where import Where
from orchestrator.recipe.model import SamplerSpec, Source, register_kind
from orchestrator.sampling.candidates import Columns, eligible, recheck
from orchestrator.sampling.groups import Claims, Groups

Accept = Callable[[Columns, np.ndarray], np.ndarray]
"""Which of the drawn rows are complete (n-step successor, window, frame stack): bool."""


class Context(NamedTuple):
    """What a draw is given besides the columns and its count."""

    params: Mapping[str, Any]  # the recipe's live params (the where may name them)
    rng: np.random.Generator
    now: float  # the clock (age windows, group waits)
    max_priority: float  # what an unset priority counts as (1.0 unless a sampler needs it)
    accept: Accept | None = None  # rows failing it are redrawn (row samplers)
    claims: Claims | None = None  # a ``once`` recipe's groups delivered in this pass


class Part(NamedTuple):
    """One source's share of a batch."""

    rows: np.ndarray  # int64 global rows
    weights: np.ndarray  # float32 importance weights, one per row
    groups: Groups | None = None  # group samplers: which group and trajectory each row is


class Sampler(ABC):
    """One source's candidates and what it draws them with.

    Subclasses set :attr:`Spec` and implement :meth:`draw`; they keep extra state through
    three hooks the base calls: :meth:`built` (the candidates were recomputed whole),
    :meth:`updated` (some rows were re-evaluated) and :meth:`dropped` (forget it all).
    """

    Spec: ClassVar[type[SamplerSpec]]
    """The recipe keys of this kind (its ``kind`` names it)."""
    needs_max_priority: ClassVar[bool] = False
    """Whether :attr:`Context.max_priority` must be the namespace's (costs a max tree)."""

    def __init__(self, source: Source, where: Where, tags: Mapping[str, str]) -> None:
        self.source, self.where, self.spec = source, where, source.sampler
        self.n = 0  # candidates
        self.version = 0  # bumps on every change of the candidates or what they weigh
        self.cand: np.ndarray | None = None  # bool per global row; None: not built
        self._params: Mapping[str, Any] = {}
        self._key: tuple[Any, ...] | None = None  # the resolved where it was built for

    @abstractmethod
    def draw(self, columns: Columns, k: int, ctx: Context) -> Part:
        """``k`` rows (group samplers: ``k`` groups) of the source. Raises
        :class:`~orchestrator.sampling.candidates.InsufficientData` when it cannot."""

    def invalidate(self) -> None:
        """Forget the state; the next draw rebuilds it from the columns."""
        self.cand = None
        self.dropped()

    def refresh(self, columns: Columns, rows: np.ndarray) -> None:
        """Re-evaluate ``rows`` (their metadata changed: insert, priority, eviction, curation)."""
        if self.cand is None:
            return
        rows, cand, delta = recheck(self.cand, columns, rows, self.where, self._params)
        self.n += delta
        self.updated(columns, rows, cand)
        self.version += 1

    def candidates(self, columns: Columns, params: Mapping[str, Any]) -> None:
        """Make :attr:`cand` current for ``params`` (rebuilt when the where resolves to
        something else than last time); call first in :meth:`draw`."""
        key = self.where.key(params)
        if self.cand is not None and key == self._key:
            return
        self.cand = eligible(columns) & self.where.mask(columns, params)
        self._params, self._key = dict(params), key
        self.n = int(self.cand.sum())
        self.version += 1
        self.built(columns)

    # ---- hooks ---------------------------------------------------------------------
    def built(self, columns: Columns) -> None:
        """:attr:`cand` was recomputed from the columns."""
        return

    def updated(self, columns: Columns, rows: np.ndarray, cand: np.ndarray) -> None:
        """``rows`` (unique) were re-evaluated; ``cand`` is whether each is a candidate."""
        return

    def dropped(self) -> None:
        """:meth:`invalidate` was called: release what was built."""
        return


SAMPLERS: dict[str, type[Sampler]] = {}
"""The class behind each ``sampler.kind`` of a recipe source, in registration order."""


def register(cls: type[Sampler]) -> type[Sampler]:
    """Class decorator: ``cls`` draws the sources of its :attr:`Sampler.Spec`'s kind."""
    kind = register_kind(cls.Spec)
    if SAMPLERS.get(kind, cls) is not cls:
        raise ValueError(f"sampler kind {kind!r} is registered twice")
    SAMPLERS[kind] = cls
    return cls

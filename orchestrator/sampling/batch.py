"""The batch a trainer gets, one type on both paths: :func:`orchestrator.sample` returns it
as drawn, ``BatchClient.pop`` as the prefetch workers augmented and collated it.

``len(batch)`` is its rows (B: the drawn steps, or windows with ``sequence_length``).
``batch[name]`` is a field in recipe order: a numeric array (from ``sample`` a ragged field
is a list of arrays; a popped batch has it padded, with ``<name>_lengths``). What is not a
number is in ``batch.meta``, one entry per row (nested ``[B][L]`` for sequences): string
fields (``task_id``, ``episode_id``, string ``tags.<name>``; None = missing) and ``info``
dicts, ``batch.meta["task_id"][i]``; ``batch["task_id"]`` raises a ``KeyError`` that
points there. Per row: ``ids`` (int64 step ids, for ``update_priorities``), ``weights``
(float32 importance weights) and ``source_index`` (int16, into ``sources``).
``recipe_version`` is the version of the recipe that made the batch; ``groups`` (group
recipes, from ``sample`` only: a popped batch has them as ``group_index``, ... arrays) each
row's group and trajectory; ``claim`` (``once`` group recipes, popped batches too) the
groups the batch claimed, which a batch dropped unserved gives back
(``orchestrator.sampling.groups.release``). A popped batch also names what replays it
(``claw replay``): ``seed``, the seed its augmentation drew from, and ``recipe_digest``,
the content address of the recipe version that made it (None on a drawn batch).
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView, Mapping
from typing import Any

import numpy as np

from orchestrator.sampling.groups import Claim, Groups

__all__ = ["Batch", "part_order", "take_rows"]

Rows = np.ndarray | slice


def take_rows(value: Any, rows: Rows) -> Any:
    """Rows ``rows`` of one field or meta entry (an array, or a list with one item a row)."""
    if isinstance(value, np.ndarray) or isinstance(rows, slice):
        return value[rows]
    return [value[i] for i in np.asarray(rows).tolist()]


def part_order(n: int, parts: int) -> np.ndarray:
    """The rows of an ``n``-row batch with those of part ``j`` (rows ``j::parts``) at
    ``j*m:(j+1)*m``, ``m = n // parts``: each part contiguous, with the mix of sources a
    recipe's row order gives every stride."""
    return np.arange(n).reshape(-1, parts).T.ravel()


def _is_meta(value: Any) -> bool:
    """Strings (object arrays) and lists of anything but arrays (``info`` dicts); a list of
    arrays is a ragged field."""
    if isinstance(value, np.ndarray):
        return value.dtype.hasobject
    items = list(value)
    if items and all(isinstance(x, list) for x in items):  # sequence windows: [B][L]
        items = [y for x in items for y in x]
    return not (items and all(isinstance(x, np.ndarray) for x in items))


class Batch:
    """One batch of a recipe: fields by name, ``meta`` and per-row bookkeeping (see the
    module docstring). ``len()`` counts rows; iterating yields the field names."""

    __slots__ = (
        "claim",
        "fields",
        "groups",
        "ids",
        "meta",
        "recipe_digest",
        "recipe_version",
        "seed",
        "source_index",
        "sources",
        "weights",
    )

    def __init__(
        self,
        fields: dict[str, Any],
        ids: np.ndarray,
        weights: np.ndarray,
        source_index: np.ndarray,
        sources: tuple[str, ...],
        recipe_version: int,
        meta: dict[str, Any] | None = None,
        groups: Groups | None = None,
        claim: Claim | None = None,
        seed: int | None = None,
        recipe_digest: str | None = None,
    ) -> None:
        self.fields = fields
        self.ids = ids
        self.weights = weights
        self.source_index = source_index
        self.sources = sources
        self.recipe_version = recipe_version
        self.meta = {} if meta is None else meta
        self.groups = groups
        self.claim = claim  # a once batch's claims: given back if it is dropped unserved
        self.seed = seed  # what its augmentation drew from
        self.recipe_digest = recipe_digest  # its recipe version's content address

    @classmethod
    def drawn(
        cls,
        values: Mapping[str, Any],
        ids: np.ndarray,
        weights: np.ndarray,
        source_index: np.ndarray,
        sources: tuple[str, ...],
        recipe_version: int,
        groups: Groups | None = None,
    ) -> Batch:
        """A batch from the values a draw read: strings and ``info`` go to ``meta`` as lists
        (as a popped batch has them), the rest are its fields."""
        fields, meta = {}, {}
        for name, value in values.items():
            if _is_meta(value):
                meta[name] = value.tolist() if isinstance(value, np.ndarray) else value
            else:
                fields[name] = value
        return cls(fields, ids, weights, source_index, sources, recipe_version, meta, groups)

    def take(self, rows: Rows, groups: Groups | None = None) -> Batch:
        """The batch of rows ``rows`` (views where the fields are arrays and ``rows`` a
        slice); ``groups`` are the new batch's (a group's rows cannot be cut generically)."""
        return Batch(
            {k: take_rows(v, rows) for k, v in self.fields.items()},
            self.ids[rows],
            self.weights[rows],
            self.source_index[rows],
            self.sources,
            self.recipe_version,
            {k: take_rows(v, rows) if isinstance(v, list) else v for k, v in self.meta.items()},
            groups,
            self.claim,
            recipe_digest=self.recipe_digest,  # no seed: its augmentation was the batch's
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            if name in self.meta:
                raise KeyError(f"{name!r} is not an array: see batch.meta[{name!r}]") from None
            raise

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def keys(self) -> KeysView[str]:
        return self.fields.keys()

    def values(self) -> Any:
        return self.fields.values()

    def items(self) -> Any:
        return self.fields.items()

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{k}: {v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray) else f"{k}: [{len(v)}]"
            for k, v in self.fields.items()
        )
        return f"Batch(n={len(self)}, v{self.recipe_version}, {{{shapes}}})"

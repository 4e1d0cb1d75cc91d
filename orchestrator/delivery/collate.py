"""Collation: a sampled (and augmented) batch's fields as wire arrays.

:func:`orchestrator.sample` returns numeric fields as arrays and ragged fields as lists of
arrays (nested ``[B][L]`` for sequences); strings and ``info`` are already in the batch's
``meta`` (:mod:`orchestrator.sampling.batch`). The wire format carries numeric arrays only,
so prefetch collates:

- numeric arrays pass through unchanged;
- a ragged field ``x`` (e.g. ``prompt_ids``, int32[*]) becomes one zero-padded array
  ``x`` of shape ``(B, maxlen, ...)`` (``(B, L, maxlen, ...)`` with ``sequence_length`` L),
  ``maxlen`` the longest row of the batch, plus ``x_lengths``, int32 ``(B,)`` (``(B, L)``),
  each row's true length: ``x[i, :x_lengths[i]]`` is row i.

A recipe's ``layout.dtypes`` then casts fields to the dtypes its trainer takes
(:func:`cast`), so the trainer wraps the delivered bytes as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from orchestrator.delivery.wire import Pending

LENGTHS_SUFFIX = "_lengths"


def collate(fields: Mapping[str, Any]) -> dict[str, np.ndarray | Pending]:
    """``fields`` as wire arrays (see the module docstring); :class:`Pending` ones pass."""
    arrays: dict[str, np.ndarray | Pending] = {}
    for name, value in fields.items():
        if isinstance(value, Pending) or (
            isinstance(value, np.ndarray) and not value.dtype.hasobject
        ):
            arrays[name] = value
            continue
        leaves, shape = ([], ()) if isinstance(value, np.ndarray) else _leaves(value)
        if not (leaves and all(isinstance(x, np.ndarray) for x in leaves)):
            raise TypeError(f"field {name!r}: not numeric (strings and info belong in meta)")
        lengths_name = f"{name}{LENGTHS_SUFFIX}"
        if lengths_name in fields:
            raise ValueError(f"field {name!r}: {lengths_name!r} is a field of the recipe too")
        padded, lengths = _pad(name, leaves)
        arrays[name] = padded.reshape(*shape, *padded.shape[1:])
        arrays[lengths_name] = lengths.reshape(shape)
    return arrays


def _leaves(value: Any) -> tuple[list[Any], tuple[int, ...]]:
    """The items of a list, or of a list of lists (sequence windows), and its shape."""
    items = list(value)
    if items and all(isinstance(x, list) for x in items):
        widths = {len(x) for x in items}
        if len(widths) != 1:
            raise ValueError(f"ragged nesting of lists: widths {sorted(widths)}")
        return [y for x in items for y in x], (len(items), widths.pop())
    return items, (len(items),)


def _pad(name: str, rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    tail, dtype = rows[0].shape[1:], rows[0].dtype
    if any(r.shape[1:] != tail or r.dtype != dtype for r in rows):
        raise ValueError(f"field {name!r}: rows differ in dtype or trailing shape")
    lengths = np.fromiter((len(r) for r in rows), np.int32, len(rows))
    out = np.zeros((len(rows), int(lengths.max(initial=0)), *tail), dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, lengths


def cast(arrays: dict[str, Any], dtypes: Mapping[str, Any]) -> dict[str, Any]:
    """``arrays`` with each one named in ``dtypes`` cast to its dtype (numeric arrays; a
    :class:`Pending` one stays as laid out)."""
    out = dict(arrays)
    for name, dtype in dtypes.items():
        arr = out.get(name)
        if isinstance(arr, np.ndarray) and arr.dtype != dtype:
            out[name] = arr.astype(dtype)
    return out

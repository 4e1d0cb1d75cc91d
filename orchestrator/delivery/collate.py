"""Collation: a sampled (and augmented) batch's fields as wire arrays plus batch metadata.

:func:`orchestrator.sample` returns numeric fields as arrays, ragged fields as lists of
arrays, strings as object arrays and ``info`` as dicts (nested ``[B][L]`` for sequences).
The wire format carries numeric arrays only, so prefetch collates:

- numeric arrays pass through unchanged;
- a ragged field ``x`` (e.g. ``prompt_ids``, int32[*]) becomes one zero-padded array
  ``x`` of shape ``(B, maxlen, ...)`` (``(B, L, maxlen, ...)`` with ``sequence_length`` L),
  ``maxlen`` the longest row of the batch, plus ``x_lengths``, int32 ``(B,)`` (``(B, L)``),
  each row's true length: ``x[i, :x_lengths[i]]`` is row i;
- strings (``task_id``, ``episode_id``, string ``tags.<name>``…; None = missing) and
  ``info`` dicts go to the batch's ``meta`` as lists (nested for sequences):
  ``batch.meta["task_id"][i]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

LENGTHS_SUFFIX = "_lengths"


def collate(fields: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Split ``fields`` into wire arrays and ``meta`` (see the module docstring)."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                meta[name] = value.tolist()  # decoded strings (None = missing)
            else:
                arrays[name] = value
            continue
        leaves, shape = _leaves(value)
        if leaves and all(isinstance(x, np.ndarray) for x in leaves):
            lengths_name = f"{name}{LENGTHS_SUFFIX}"
            if lengths_name in fields:
                raise ValueError(f"field {name!r}: {lengths_name!r} is a field of the recipe too")
            padded, lengths = _pad(name, leaves)
            arrays[name] = padded.reshape(*shape, *padded.shape[1:])
            arrays[lengths_name] = lengths.reshape(shape)
        else:
            meta[name] = value  # info dicts (msgpack-able: str/int/float/bool values)
    return arrays, meta


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

"""A compressed field's rows as the frames the commit stores, one hash entry per step
(``z:<field>:<chunk>``, slot -> frame), and how stored frames read back.

Rows arrive raw (the ingest worker encodes them: ``Ingestor(compress_at="worker")``) or as
frames a producer encoded (:class:`~claw_tasks.format.encoded.Encoded`, checked before the
commit by ``StepBatch.row_errors``). ``delta`` frames are made here, where the steps'
episode runs and ids are known.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from claw_tasks.codecs import CodecError, decode, encode
from claw_tasks.codecs.delta import (
    decode_with_keys,
    encode_groups,
    key_body,
    key_frame,
    needed_keys,
)
from claw_tasks.format.columns import FieldValue, Placed, Ragged
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.schema import FieldSpec
from claw_tasks.settings import get_settings
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS


@functools.cache
def codec_threads() -> int:
    """Threads a batch's frames are encoded or decoded in (``CLAW_CODEC_THREADS``)."""
    return get_settings().codec_threads


def raw_rows(spec: FieldSpec, v: FieldValue) -> np.ndarray | list[np.ndarray]:
    """Rows as arrays: ``Encoded`` ones decoded (their frames were checked first)."""
    if isinstance(v, Placed):
        raise CodecError("a compressed field is never written in place")
    if isinstance(v, Encoded) and v.decoded is not None:  # decoded by the ingest check
        return v.decoded.view(v.dtype).reshape(len(v), *v.shape[1:])
    if isinstance(v, Encoded):
        return decode(v.codec, list(v.frames), v.dtype, tuple(v.shape[1:]), codec_threads())
    if isinstance(v, Ragged):
        off = v.offsets
        return [v.values[off[i] : off[i + 1]] for i in range(len(v))]
    return v


def frames_of(
    spec: FieldSpec, v: FieldValue, ids: np.ndarray, runs: list[np.ndarray]
) -> list[bytes | memoryview]:
    """The stored frames of a part's rows of field ``spec`` (``v`` already the part's
    rows); ``ids`` are the steps' ids and ``runs`` their episodes' runs (delta only)."""
    codec = spec.codec
    assert codec is not None
    if codec.name == "delta":
        return encode_groups(codec, raw_rows(spec, v), ids, runs)  # type: ignore[arg-type]  # a delta field is fixed-shape: rows are arrays
    if isinstance(v, Encoded):
        return list(v.frames)  # stored as sent: no decode/encode round trip
    return list(encode(codec, raw_rows(spec, v), codec_threads()))


def explicit_frames(spec: FieldSpec, v: FieldValue) -> list[bytes | memoryview]:
    """Frames of explicit ``next_obs`` rows of a compressed ``obs``. Always
    self-contained: a ``delta`` obs stores key frames with id 0."""
    codec = spec.codec
    assert codec is not None
    if codec.name == "delta":
        rows = np.asarray(raw_rows(spec, v))
        eng = encode(codec, rows, codec_threads())
        return [key_frame(bytes(key_body(f)), 0) for f in eng]  # id 0: no step's own frame
    if isinstance(v, Encoded):
        return list(v.frames)
    return list(encode(codec, raw_rows(spec, v), codec_threads()))


def decode_stored(store: StoreCore, name: str, spec: FieldSpec, frames: list[Any]) -> Any:
    """Stored frames of field ``name`` (``None``/empty: zeros) as rows: an ``(n, ...)``
    array, or a list for a ragged field. A ``delta`` field's key frames not among
    ``frames`` are read in one more round trip (random access reads at most a key and
    the step's own frame)."""
    codec = spec.codec
    assert codec is not None
    if codec.name != "delta":
        rows = decode(codec, frames, spec.dtype, spec.shape, codec_threads())
        return list(rows) if spec.ragged else rows
    need = sorted(needed_keys(frames))
    keys: dict[int, Any] = {}
    if need:
        cfg = store.config()
        with store.r.pipeline(transaction=False) as pipe:
            for i in need:
                slot = (i // cfg.n_shards - 1) % cfg.cap
                key = store.layout_keys.compressed(
                    i % cfg.n_shards, name, slot // SPARSE_CHUNK_SLOTS
                )
                pipe.hget(key, slot)
            keys = dict(zip(need, pipe.execute(), strict=True))
    shape = tuple(int(d) for d in spec.shape)  # type: ignore[arg-type]  # a compressed fixed field: no None in its shape
    return decode_with_keys(codec, frames, keys, spec.dtype, shape)

"""Array framing for msgpack: dtype, shape and raw bytes, lz4 above a threshold.

A frame is the list ``[dtype, shape, data, compressed]``. Decoding an uncompressed frame
is zero-copy (``np.frombuffer`` over the message bytes). Never pickle: object arrays are
refused.
"""

from __future__ import annotations

from typing import Any

import lz4.block
import msgpack
import numpy as np

COMPRESS_MIN_BYTES = 64 * 1024
_KEEP_RATIO = 0.9

Frame = list[Any]


class CodecError(ValueError):
    """A value cannot be framed or a frame is malformed."""


def check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.hasobject or dtype.kind not in "biufc" or dtype.fields is not None:
        raise CodecError(f"{what}: unsupported type {dtype} (numeric arrays only)")


def frame(arr: np.ndarray, *, compress: bool = True) -> Frame:
    """Frame an array; lz4-compress it when large and it pays off."""
    check_dtype(arr.dtype, "array")
    arr = np.ascontiguousarray(arr)
    data = arr.data.cast("B") if arr.size else b""
    if compress and arr.nbytes >= COMPRESS_MIN_BYTES:
        packed = lz4.block.compress(data, store_size=True)
        if len(packed) < _KEEP_RATIO * arr.nbytes:
            return [arr.dtype.str, list(arr.shape), packed, True]
    return [arr.dtype.str, list(arr.shape), data, False]  # msgpack packs the view: no copy


def unframe(f: Frame) -> np.ndarray:
    """Decode a frame (zero-copy when it is not compressed; read-only then)."""
    try:
        dtype_str, shape, data, compressed = f
        dtype = np.dtype(dtype_str)
    except (TypeError, ValueError) as e:
        raise CodecError(f"malformed array frame: {e}") from None
    check_dtype(dtype, "frame")
    if compressed:
        data = lz4.block.decompress(data)
    arr = np.frombuffer(data, dtype=dtype)
    try:
        return arr.reshape(shape)
    except ValueError:
        raise CodecError(f"frame of {arr.size} items does not fit shape {shape}") from None


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)

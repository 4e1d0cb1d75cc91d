"""Packed arrays for msgpack: dtype, shape and raw bytes, lz4 above a threshold.

A packed array is the list ``[dtype, shape, data, compressed]``. Unpacking an uncompressed one
is zero-copy (``np.frombuffer`` over the message bytes). Never pickle: object arrays are
refused.
"""

from __future__ import annotations

import math
from typing import Any

import lz4.block
import msgpack
import numpy as np

from claw_tasks.codecs.errors import CodecError, lz4_inflate

COMPRESS_MIN_BYTES = 64 * 1024
_KEEP_RATIO = 0.9

PackedArray = list[Any]


def check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.hasobject or dtype.kind not in "biufc" or dtype.fields is not None:
        raise CodecError(f"{what}: unsupported type {dtype} (numeric arrays only)")


def pack_array(arr: np.ndarray, *, compress: bool = True) -> PackedArray:
    """Pack an array; lz4-compress it when large and it pays off."""
    check_dtype(arr.dtype, "array")
    arr = np.ascontiguousarray(arr)
    data = arr.data.cast("B") if arr.size else b""
    if compress and arr.nbytes >= COMPRESS_MIN_BYTES:
        packed = lz4.block.compress(data, store_size=True)
        if len(packed) < _KEEP_RATIO * arr.nbytes:
            return [arr.dtype.str, list(arr.shape), packed, True]
    return [arr.dtype.str, list(arr.shape), data, False]  # msgpack packs the view: no copy


class Budget:
    """Bytes that decompressing may still produce for one message (a bomb stops at the
    lz4 header, before any memory is taken)."""

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit

    def take(self, nbytes: int, what: str) -> None:
        if nbytes > self.left:
            raise CodecError(
                f"{what}: decompresses to {nbytes} bytes, over the {self.limit}-byte budget "
                "of one batch (CLAW_MAX_DECOMPRESSED_BYTES)"
            )
        self.left -= nbytes


MAX_NDIM = 32


def unpack_array(f: PackedArray, budget: Budget | None = None) -> np.ndarray:
    """Unpack an array (zero-copy when it is not compressed; read-only then). Every length
    is checked against the declared dtype and shape before any memory is taken."""
    if not isinstance(f, list | tuple) or len(f) != 4:
        raise CodecError("malformed packed array: expected [dtype, shape, data, compressed]")
    dtype_str, shape, data, compressed = f
    if not isinstance(dtype_str, str) or len(dtype_str) > 16:
        raise CodecError(f"malformed packed array: dtype {dtype_str!r:.40} is not a type name")
    try:
        dtype = np.dtype(dtype_str)
    except (TypeError, ValueError) as e:
        raise CodecError(f"malformed packed array: {e}") from None
    check_dtype(dtype, "packed array")
    if (
        not isinstance(shape, list | tuple)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d < 2**31 for d in shape)
    ):
        raise CodecError(f"malformed packed array: shape {shape!r:.80} (integers in [0, 2**31))")
    if not isinstance(data, bytes) or not isinstance(compressed, bool):
        raise CodecError("malformed packed array: data must be bytes, compressed a bool")
    nbytes = math.prod(shape) * dtype.itemsize
    if compressed:
        declared = int.from_bytes(data[:4], "little") if len(data) >= 4 else -1
        if declared != nbytes:
            raise CodecError(
                f"lz4 frame declares {declared} bytes, its shape {list(shape)} of {dtype} "
                f"holds {nbytes}"
            )
        if budget is not None:
            budget.take(nbytes, "lz4 frame")
        data = lz4_inflate(data, nbytes)
    if len(data) != nbytes:
        raise CodecError(
            f"packed array of {len(data)} bytes does not fit shape {list(shape)} of {dtype}"
        )
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except ValueError as e:
        raise CodecError(f"packed array of shape {list(shape)}: {e}") from None


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)

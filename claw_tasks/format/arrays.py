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
    """Decoded bytes one message may cost the worker, reserved for all its frames (lz4
    array frames and compressed fields' frames) from their headers before any is
    inflated: a bomb stops before any memory is taken. A frame costs its declared size,
    and the largest costs it once more: python-lz4 inflates into a buffer of its own and
    copies that into the bytes it returns, so the frame being inflated is held twice."""

    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.largest = limit, 0, 0
        self.unspent = 0  # reserved lz4 bytes not inflated yet

    def reserve(self, sizes: list[int], *, lz4: bool) -> None:
        """Add frames' declared sizes (``lz4``: array frames, spent by :func:`unpack_array`)."""
        sizes = [max(0, s) for s in sizes]
        total, largest = self.total + sum(sizes), max([self.largest, *sizes])
        if total + largest > self.limit:
            raise CodecError(
                f"the frames of this batch decompress to {total} bytes, {total + largest} "
                f"with the largest ({largest}) held twice while it inflates: over the "
                f"{self.limit}-byte budget of one batch (CLAW_MAX_DECOMPRESSED_BYTES): send "
                "fewer steps per message (Ingestor flush_steps) or raise it"
            )
        self.total, self.largest = total, largest
        if lz4:
            self.unspent += sum(sizes)

    def spend(self, nbytes: int) -> None:
        """Inflate a reserved lz4 frame (a frame not reserved first is a decoder bug)."""
        if nbytes > self.unspent:
            raise CodecError(f"lz4 frame of {nbytes} bytes was not reserved before inflating")
        self.unspent -= nbytes


MAX_NDIM = 32


def _parse(f: Any) -> tuple[np.dtype, list[int], bytes, bool, int]:
    """A frame's parts and its decoded byte count, every length checked against the
    declared dtype and shape (an lz4 frame's header too); nothing inflated."""
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
    return dtype, list(shape), data, compressed, nbytes


def lz4_sizes(message: Any) -> list[int]:
    """Decoded sizes of the well-formed lz4 frames anywhere in a decoded message (headers
    read, nothing inflated): every frame :func:`unpack_array` could inflate is one of them. A
    malformed one is left to the decoder, which refuses it before inflating."""
    sizes, stack = [], [message]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            if len(v) == 4 and v[3] is True:
                try:
                    sizes.append(_parse(v)[4])
                    continue
                except CodecError:
                    pass
            stack.extend(v)
    return sizes


def unpack_array(f: PackedArray, budget: Budget | None = None) -> np.ndarray:
    """Decode a frame (zero-copy when it is not compressed; read-only then). Every length
    is checked against the declared dtype and shape before any memory is taken; with a
    ``budget``, an lz4 frame must have been reserved in it."""
    dtype, shape, data, compressed, nbytes = _parse(f)
    if compressed:
        if budget is not None:
            budget.spend(nbytes)
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

"""A batch of one field's rows through a codec: encode, decode, and the trust checks an
ingest worker makes on frames from a producer before they are stored.

``threads`` > 1 splits the rows over a thread pool: zstd, lz4, OpenCV and Pillow release the GIL
while they work, so decoding (in the prefetch workers) and augmentation stay off the
trainer and use the worker's cores. Contexts are per thread (zstandard's are not thread
safe).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from claw_tasks.codecs.delta import key_body, key_frame
from claw_tasks.codecs.engines import Engine, engine_for
from claw_tasks.codecs.errors import CodecError
from claw_tasks.codecs.frames import CodecFrames
from claw_tasks.codecs.spec import Codec

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
MIN_ROWS_PER_THREAD = 16


def _parallel(n: int, threads: int, work: Callable[[int, int], Any]) -> list[Any]:
    """``work(lo, hi)`` over row ranges: inline, or split over a pool of ``threads``."""
    parts = min(threads, max(1, n // MIN_ROWS_PER_THREAD))
    if parts <= 1:
        return [work(0, n)]
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="claw-codec")
    step = math.ceil(n / parts)
    futures = [pool.submit(work, lo, min(n, lo + step)) for lo in range(0, n, step)]
    return [f.result() for f in futures]


def encode(
    codec: Codec, values: np.ndarray | Sequence[np.ndarray], threads: int = 1
) -> CodecFrames:
    """One frame per row of ``values`` (an ``(n, ...)`` array, or ragged rows).

    A ``delta`` codec encodes each row as a key frame here; the store turns an episode's
    steps into key frames and deltas when it commits them (``claw_tasks.codecs.delta``)."""
    if isinstance(values, np.ndarray):  # rows as arrays (a scalar row would lose its byte order)
        shape = values.shape[1:]
        flat = np.ascontiguousarray(values).reshape(len(values), -1)
        values = [flat[i].reshape(shape) for i in range(len(flat))]
    if codec.name == "delta":

        def work(lo: int, hi: int) -> list[bytes]:
            eng = engine_for(codec)
            return [key_frame(eng.encode(values[i]), 0) for i in range(lo, hi)]
    else:

        def work(lo: int, hi: int) -> list[bytes]:
            eng = engine_for(codec)
            return [eng.encode(values[i]) for i in range(lo, hi)]

    return CodecFrames.of([f for part in _parallel(len(values), threads, work) for f in part])


def decode(
    codec: Codec,
    frames: Sequence[bytes | memoryview | None],
    dtype: Any,
    shape: tuple[int | None, ...],
    threads: int = 1,
) -> np.ndarray | list[np.ndarray]:
    """The rows of ``frames``: an ``(n, *shape)`` array for a fixed shape (an empty or
    None frame reads as zeros, as a missing row does), a list of ``(-1, *shape[1:])``
    arrays for a ragged one. A frame that does not decode to the field's size raises
    CodecError. ``delta`` frames must be key frames here (``delta.resolve`` first)."""
    dt = np.dtype(dtype)
    n = len(frames)
    if shape and shape[0] is None:
        tail = tuple(shape[1:])
        item = dt.itemsize * math.prod(tail)

        def ragged(lo: int, hi: int) -> list[np.ndarray]:
            eng = engine_for(codec)
            out = []
            for i in range(lo, hi):
                f = frames[i]
                raw = b"" if not f else eng.decode(f, _ragged_size(eng, f, item), ())
                out.append(np.frombuffer(raw, dt).reshape(-1, *tail))
            return out

        return [a for part in _parallel(n, threads, ragged) for a in part]
    fixed_shape = tuple(int(d) for d in shape)  # type: ignore[arg-type]  # not ragged here: a fixed shape (no None)
    nbytes = dt.itemsize * math.prod(fixed_shape)
    out = np.empty((n, nbytes), np.uint8)  # every row written below (zeros: no fresh pages)

    def fixed(lo: int, hi: int) -> None:
        eng = engine_for(codec)
        strip = key_body if codec.name == "delta" else None
        for i in range(lo, hi):
            f = frames[i]
            if f:
                body = strip(f) if strip else f
                eng.decode_into(body, out[i], fixed_shape)
            else:
                out[i] = 0

    _parallel(n, threads, fixed)
    return out.view(dt).reshape(n, *fixed_shape)


def _ragged_size(eng: Engine, frame: bytes | memoryview, item: int) -> int:
    size = eng.declared(frame)
    if item and size % item:
        raise CodecError(f"frame declares {size} bytes, not a whole number of {item}-byte items")
    return size


def frame_problem(
    codec: Codec,
    frame: bytes | memoryview,
    dtype: Any,
    shape: tuple[int | None, ...],
    max_bytes: int,
    verify: bool = True,
) -> str | None:
    """What is wrong with one frame from a producer (None: nothing), checked before it is
    stored: its header must declare exactly the field's row size (for a ragged field a
    whole number of items, at most ``max_bytes``); with ``verify`` it is also decoded,
    bounded by that size, so a frame that lies about its size or is corrupt never reaches
    a prefetch worker or a thumbnail."""
    dt = np.dtype(dtype)
    ragged = bool(shape) and shape[0] is None
    dims = tuple(int(d) for d in (shape[1:] if ragged else shape))  # type: ignore[arg-type]  # the ragged dimension is dropped: no None left
    item = dt.itemsize * math.prod(dims)
    eng = engine_for(codec)
    try:
        body = key_body(frame) if codec.name == "delta" else frame
        declared = eng.declared(body)
        if ragged:
            if (item and declared % item) or declared > max_bytes:
                return (
                    f"{codec} frame declares {declared} decoded bytes: a ragged row of "
                    f"{dt.name}{list(dims)} items takes a multiple of {item}, at most {max_bytes}"
                )
        elif declared != item:
            return (
                f"{codec} frame declares {declared} decoded bytes, the field's "
                f"{dt.name}{list(dims)} row holds {item}"
            )
        if verify:
            eng.decode(body, declared, dims)
    except CodecError as e:
        return f"{codec} frame: {e}"
    return None

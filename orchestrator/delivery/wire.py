"""Batch wire format: a msgpack header that describes raw, aligned array bytes.

Layout of an encoded batch::

    b"CLAW" | u32 format version | u32 header length | msgpack header | pad | array bytes ...

(integers little endian). The magic and the version come first in every version of the
format, so a reader checks the version before it interprets anything else and refuses a
version it does not know (:class:`WireVersionError`) instead of misreading it. Bump
:data:`VERSION` on any change a reader of the previous version would misread.

The header names each array as ``[dtype.str, shape, offset]``; every array body starts at an
offset that is a multiple of ``ALIGN`` from the start of the buffer, so :func:`decode_batch`
returns ``np.frombuffer`` views of the input buffer: no array byte is copied. Arrays decoded
from ``bytes`` are read-only; decode a writable buffer (``bytearray``, ``mmap``) to get
writable arrays. Never pickle.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
from numpy.typing import ArrayLike

from orchestrator.sampling.batch import Batch
from orchestrator.sampling.groups import Claim

MAGIC = b"CLAW"
VERSION = 2
"""Version of the queue item format: encoded batches and shared-memory references."""
ALIGN = 64
_PREFIX = struct.Struct("<4sII")  # magic, version, header length
_RESERVED = ("ids", "weights", "source_index")

ArraySpec = list[Any]  # [dtype str, shape list, offset]


class WireVersionError(ValueError):
    """A queue item written in a wire format version this reader does not know."""


def check_version(version: int, what: str = "batch") -> None:
    """Refuse ``version`` unless it is this reader's :data:`VERSION`; the error names both
    versions and which side to upgrade."""
    if version == VERSION:
        return
    if version > VERSION:
        fix = (
            "it was written by a newer Claw: upgrade Claw where this reader runs (the "
            "trainer) to the version the prefetch workers run"
        )
    else:
        fix = (
            "it was written by an older Claw: upgrade and restart the prefetch workers, then "
            "register the recipe again to drop the batches already queued"
        )
    raise WireVersionError(
        f"{what} is in wire format version {version}, this reader reads version {VERSION}: {fix}"
    )


class Pending:
    """A field whose array is laid out now and written later (:meth:`WireBatch.write_into`
    hands out views of the destination), so it can be computed straight into shared memory."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: Any, shape: Sequence[int]) -> None:
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class WireBatch:
    """A batch laid out for the wire but not yet copied anywhere.

    ``nbytes`` is the encoded size; ``chunks()`` yields the buffers whose concatenation is the
    encoding, so a writer can stream them into a socket, a file or shared memory directly.
    ``pending`` names the :class:`Pending` fields, by their offset in the encoding; their
    bytes are there once :meth:`place` or :meth:`write_into` filled them.
    """

    __slots__ = ("_chunks", "_sizes", "nbytes", "pending")

    def __init__(
        self,
        chunks: list[memoryview | None],
        nbytes: int,
        pending: dict[str, tuple[int, int, Pending]] | None = None,
    ) -> None:
        self._chunks = chunks  # None: a pending field's body
        self.nbytes = nbytes
        self.pending = pending or {}  # name -> (chunk index, offset in the encoding, spec)
        sizes = {index: spec.nbytes for index, _, spec in self.pending.values()}
        self._sizes = [sizes[i] if c is None else c.nbytes for i, c in enumerate(chunks)]

    def chunks(self) -> list[memoryview]:
        """The buffers to concatenate, in order."""
        if self.pending:
            raise ValueError(f"pending fields not written yet: {sorted(self.pending)}")
        return list(self._chunks)  # type: ignore[arg-type]  # no pending field left (checked above): every chunk is a buffer

    def tobytes(self) -> bytes:
        """The whole encoding as one ``bytes`` object."""
        return b"".join(self.chunks())

    def place(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Fill the pending fields with ``arrays`` (of their dtype and shape), by reference."""
        for name, arr in arrays.items():
            index, _, spec = self.pending.pop(name)
            if arr.dtype != spec.dtype or arr.shape != spec.shape:
                raise ValueError(
                    f"field {name!r}: {arr.dtype}{arr.shape} laid out as {spec.dtype}{spec.shape}"
                )
            self._chunks[index] = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))

    def write_into(self, buf: Any) -> dict[str, np.ndarray]:
        """Copy the encoding into ``buf`` (writable, ``nbytes`` or longer) but for the pending
        fields, and return those as writable views of ``buf`` to be filled in place."""
        mv = memoryview(buf).cast("B")
        pos = 0
        for chunk, size in zip(self._chunks, self._sizes, strict=True):
            if chunk is not None:
                mv[pos : pos + size] = chunk
            pos += size
        return {
            name: np.frombuffer(mv, spec.dtype, math.prod(spec.shape), off).reshape(spec.shape)
            for name, (_, off, spec) in self.pending.items()
        }


def _check_array(name: str, arr: np.ndarray | Pending, n: int) -> None:
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise ValueError(
            f"field {name!r}: dtype {arr.dtype} cannot go on the wire (object/structured)"
        )
    if arr.ndim == 0 or arr.shape[0] != n:
        raise ValueError(f"field {name!r}: leading dimension {arr.shape[:1]} != batch size {n}")


def _row_array(name: str, value: ArrayLike | None, dtype: type, n: int, fill: int) -> np.ndarray:
    if value is None:
        return np.full(n, fill, dtype=dtype)
    arr = np.asarray(value)
    if arr.shape != (n,):
        raise ValueError(f"{name}: shape {arr.shape} != ({n},)")
    if not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise ValueError(f"{name}: dtype {arr.dtype} cannot be cast to {np.dtype(dtype)}")
    return arr.astype(dtype, copy=False)


def to_wire(
    fields: Mapping[str, ArrayLike],
    ids: ArrayLike,
    *,
    weights: ArrayLike | None = None,
    source_index: ArrayLike | None = None,
    sources: Sequence[str] = ("default",),
    recipe_version: int = 0,
    meta: Mapping[str, Any] | None = None,
    claim: Claim | None = None,
    seed: int | None = None,
    recipe_digest: str | None = None,
) -> WireBatch:
    """Lay a batch out for the wire. Arrays are referenced, not copied (unless not contiguous);
    a :class:`Pending` field only reserves its place.

    ``weights`` default to ones, ``source_index`` to zeros; ``meta`` must be msgpack-able;
    ``claim`` (a ``once`` batch's), ``seed`` and ``recipe_digest`` (what replays it) go in
    the header (readers that do not know them ignore them)."""
    rows, names = _rows(ids, weights, source_index, sources)
    n = len(rows["ids"])
    arrays: list[tuple[str, np.ndarray | Pending]] = []
    for name, value in fields.items():
        arr = value if isinstance(value, Pending) else np.asarray(value)
        _check_array(name, arr, n)
        arrays.append((name, arr))
    arrays += [(k, rows[k]) for k in _RESERVED]
    bodies, specs, size = _layout(arrays)
    named = [[name, *spec] for (name, _), spec in zip(arrays, specs, strict=True)]
    n_fields = len(arrays) - len(_RESERVED)
    header = {
        "fields": named[:n_fields],
        **{row[0]: row[1:] for row in named[n_fields:]},
        "sources": names,
        "recipe_version": int(recipe_version),
        "meta": dict(meta or {}),
    }
    if claim is not None:
        header["claim"] = [claim.pass_no, claim.token, list(claim.ids)]
    if seed is not None:
        header["seed"] = int(seed)
    if recipe_digest is not None:
        header["recipe_digest"] = str(recipe_digest)
    try:
        head = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"batch metadata is not msgpack-serializable: {exc}") from exc
    return _assemble(head, [name for name, _ in arrays], bodies, specs, size)


def _rows(
    ids: ArrayLike,
    weights: ArrayLike | None,
    source_index: ArrayLike | None,
    sources: Sequence[str],
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The per-row arrays (``ids``, ``weights``, ``source_index``) in their wire dtypes,
    checked, and the source names."""
    ids_arr = np.asarray(ids)
    if ids_arr.ndim != 1 or (ids_arr.size and ids_arr.dtype.kind not in "iu"):
        raise ValueError(f"ids: expected a 1-d integer array, got {ids_arr.dtype}{ids_arr.shape}")
    if ids_arr.dtype == np.uint64:
        raise ValueError("ids: uint64 does not fit int64")
    n = len(ids_arr)
    rows = {
        "ids": ids_arr.astype(np.int64, copy=False),
        "weights": _row_array("weights", weights, np.float32, n, 1),
        "source_index": _row_array("source_index", source_index, np.int16, n, 0),
    }
    names = [str(s) for s in sources]
    si = rows["source_index"]
    if n and (si.min() < 0 or si.max() >= len(names)):
        raise ValueError(f"source_index out of range for {len(names)} sources")
    return rows, names


def _layout(
    arrays: list[tuple[str, np.ndarray | Pending]],
) -> tuple[list[np.ndarray | Pending], list[ArraySpec], int]:
    """Each array's body (its bytes, or the :class:`Pending` itself) and spec, and the size
    of all bodies, each padded to ``ALIGN``. Offsets are relative to the data start: the
    first ``ALIGN`` boundary after the header."""
    bodies: list[np.ndarray | Pending] = []
    specs, pos = [], 0
    for _, arr in arrays:
        body = arr if isinstance(arr, Pending) else np.ascontiguousarray(arr).reshape(-1)
        bodies.append(body if isinstance(body, Pending) else body.view(np.uint8))
        specs.append([arr.dtype.str, list(arr.shape), pos])
        pos += -(-arr.nbytes // ALIGN) * ALIGN
    return bodies, specs, pos


def _assemble(
    head: bytes,
    names: list[str],
    bodies: list[np.ndarray | Pending],
    specs: list[ArraySpec],
    size: int,
) -> WireBatch:
    """The encoding's chunks in order: prefix, header, padding to the data start, then each
    body (a pending one's place left empty) and its padding."""
    base = -(-(_PREFIX.size + len(head)) // ALIGN) * ALIGN
    chunks: list[memoryview | None] = [
        memoryview(c)
        for c in (
            _PREFIX.pack(MAGIC, VERSION, len(head)),
            head,
            bytes(base - _PREFIX.size - len(head)),
        )
    ]
    pending = {}
    for name, body, spec in zip(names, bodies, specs, strict=True):
        if isinstance(body, Pending):
            pending[name] = (len(chunks), base + spec[2], body)
            chunks.append(None)
        else:
            chunks.append(memoryview(body))
        if body.nbytes % ALIGN:
            chunks.append(memoryview(bytes(ALIGN - body.nbytes % ALIGN)))
    return WireBatch(chunks, base + size, pending)


def is_batch(buf: Any) -> bool:
    """Whether ``buf`` starts like an encoded batch."""
    return bytes(memoryview(buf)[:4]) == MAGIC


def decode_batch(buf: Any) -> Batch:
    """Decode a batch from any buffer (bytes, bytearray, memoryview, mmap) without copying arrays.

    The returned arrays are views of ``buf`` and keep it alive.
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < _PREFIX.size:
        raise ValueError("not a Claw batch: too short")
    magic, version, head_len = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise ValueError(f"not a Claw batch: bad magic {magic!r}")
    check_version(version)
    end = _PREFIX.size + head_len
    if end > len(mv):
        raise ValueError("truncated batch: header past end of buffer")
    header = msgpack.unpackb(mv[_PREFIX.size : end], raw=False)
    if not isinstance(header, dict):
        raise ValueError(f"corrupt batch header: {type(header).__name__}, not a map")
    base = -(-end // ALIGN) * ALIGN

    def view(spec: ArraySpec) -> np.ndarray:
        dtype, shape, off = np.dtype(spec[0]), tuple(spec[1]), base + spec[2]
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"corrupt batch: shape {shape} is not of non-negative integers")
        count = math.prod(shape)  # exact (np.prod wraps at 2**63): checked against the buffer
        if off + count * dtype.itemsize > len(mv):
            raise ValueError("truncated batch: array body past end of buffer")
        return np.frombuffer(mv, dtype=dtype, count=count, offset=off).reshape(shape)

    try:
        c = header.get("claim")
        claim = None if c is None else Claim(int(c[0]), str(c[1]), tuple(map(str, c[2])))
        return Batch(
            fields={f[0]: view(f[1:]) for f in header["fields"]},
            ids=view(header["ids"]),
            weights=view(header["weights"]),
            source_index=view(header["source_index"]),
            sources=tuple(header["sources"]),
            recipe_version=header["recipe_version"],
            meta=header["meta"],
            claim=claim,
            seed=header.get("seed"),
            recipe_digest=header.get("recipe_digest"),
        )
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"corrupt batch header: {exc!r}") from exc

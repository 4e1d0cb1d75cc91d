"""Batch wire format: a msgpack layout that describes raw, aligned array bytes.

Layout of an encoded batch::

    b"CLAW" | u32 format version | u32 layout length | u32 tail length
    | msgpack layout | pad | array bytes ... | msgpack tail

(integers little endian). The magic and the version come first in every version of the
format, so a reader checks the version before it interprets anything else and refuses a
version it does not know (:class:`WireVersionError`) instead of misreading it. Bump
:data:`VERSION` on any change a reader of the previous version would misread.

The layout names each array as ``[dtype.str, shape, offset]`` and holds what every batch of
one recipe version shares (its sources, version and digest); the tail holds what changes
from batch to batch (``meta``, ``seed``, a ``once`` batch's ``claim``; empty when there is
none). A reader parses a layout once, checking it as untrusted (:meth:`WireLayout.parse`), and
keeps it (:class:`WireLayouts`, bounded by count and bytes), keyed by its whole bytes: a batch
of a layout seen before costs a dictionary lookup and one ``np.frombuffer`` per array.
Every array body starts at an offset that is a multiple of ``ALIGN`` from the start of the
buffer, so :func:`decode_batch` returns views of the input buffer: no array byte is
copied. Arrays decoded from ``bytes`` are read-only; decode a writable buffer
(``bytearray``, ``mmap``) to get writable arrays. Never pickle.
"""

from __future__ import annotations

import math
import re
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from numpy.typing import ArrayLike

from orchestrator.sampling.batch import Batch
from orchestrator.sampling.groups import Claim

MAGIC = b"CLAW"
VERSION = 3
"""Version of the queue item format: encoded batches and shared-memory references."""
ALIGN = 64
_VERSIONED = struct.Struct("<4sI")  # magic, version: what every version starts with
_PREFIX = struct.Struct("<4sIII")  # magic, version, layout length, tail length
LAYOUTS_KEPT = 64
"""Layouts a reader keeps parsed (:class:`WireLayouts`): a recipe version's batches share one,
a token recipe's batches one per padded length."""
LAYOUTS_BYTES = 1 << 20
"""Bytes the kept layouts may hold together (:class:`WireLayouts`): a layout of ten arrays
takes ~3.5 KB (64 of them ~0.2 MB), one of 3,000 arrays is more than this alone."""
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
    ``recipe_digest`` (what replays it) goes in the layout, ``meta``, ``claim`` (a ``once``
    batch's) and ``seed`` in the tail."""
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
    layout = {
        "fields": named[:n_fields],
        **{row[0]: row[1:] for row in named[n_fields:]},
        "sources": names,
        "recipe_version": int(recipe_version),
        "recipe_digest": None if recipe_digest is None else str(recipe_digest),
        "size": size,
    }
    tail: dict[str, Any] = {}
    if meta:
        tail["meta"] = dict(meta)
    if claim is not None:
        tail["claim"] = [claim.pass_no, claim.token, list(claim.ids)]
    if seed is not None:
        tail["seed"] = int(seed)
    try:
        head = msgpack.packb(layout, use_bin_type=True)
        end = msgpack.packb(tail, use_bin_type=True) if tail else b""
    except (TypeError, ValueError) as exc:
        raise ValueError(f"batch metadata is not msgpack-serializable: {exc}") from exc
    return _assemble(head, end, [name for name, _ in arrays], bodies, specs, size)


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
    first ``ALIGN`` boundary after the layout."""
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
    tail: bytes,
    names: list[str],
    bodies: list[np.ndarray | Pending],
    specs: list[ArraySpec],
    size: int,
) -> WireBatch:
    """The encoding's chunks in order: prefix, layout, padding to the data start, then each
    body (a pending one's place left empty) and its padding, then the tail."""
    base = _data_start(len(head))
    chunks: list[memoryview | None] = [
        memoryview(c)
        for c in (
            _PREFIX.pack(MAGIC, VERSION, len(head), len(tail)),
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
    if tail:
        chunks.append(memoryview(tail))
    return WireBatch(chunks, base + size + len(tail), pending)


def _data_start(layout_len: int) -> int:
    """Where the first array body starts: the first ``ALIGN`` boundary after the layout."""
    return -(-(_PREFIX.size + layout_len) // ALIGN) * ALIGN


def is_batch(buf: Any) -> bool:
    """Whether ``buf`` starts like an encoded batch."""
    return bytes(memoryview(buf)[:4]) == MAGIC


@dataclass(frozen=True, slots=True)
class WireLayout:
    """A parsed layout: each array as ``(name, dtype, count, offset from the buffer's
    start, shape)`` (shape None: one dimension, ``count`` long), the fields first, then
    ``ids``, ``weights`` and ``source_index``; ``end`` is where the tail starts."""

    arrays: tuple[tuple[str, np.dtype, int, int, tuple[int, ...] | None], ...]
    sources: tuple[str, ...]
    recipe_version: int
    recipe_digest: str | None
    end: int

    @classmethod
    def parse(cls, raw: bytes) -> WireLayout:
        """The layout of msgpack bytes ``raw``, checked as untrusted: dtypes of
        :data:`DTYPE`'s grammar, every array a run of rows in order within the bodies'
        size (none overlapping another, each at an ``ALIGN`` boundary), the row arrays
        in their dtypes, every field as many rows as ``ids``. ValueError names what is
        wrong."""
        header = msgpack.unpackb(raw, raw=False)
        if not isinstance(header, dict):
            raise ValueError(f"corrupt batch layout: {type(header).__name__}, not a map")
        base = _data_start(len(raw))
        size, fields = header.get("size"), header.get("fields")
        if type(size) is not int or size < 0:
            raise ValueError(f"corrupt batch layout: size {size!r}")
        if not isinstance(fields, list) or not all(isinstance(f, list) for f in fields):
            raise ValueError("corrupt batch layout: fields are not a list of arrays")
        specs = [*fields, *([k, *_spec(header.get(k))] for k in _RESERVED)]
        arrays, pos = [], 0
        for spec in specs:
            arrays.append(_array(spec, base, pos, size))
            pos = arrays[-1][3] - base + arrays[-1][2] * arrays[-1][1].itemsize
        if len({a[0] for a in arrays}) != len(arrays):
            raise ValueError("corrupt batch layout: an array named twice")
        rows = arrays[-3][2]
        for (name, dtype, _, _, shape), want in zip(arrays[-3:], _ROW_DTYPES, strict=True):
            if dtype != want or shape is not None:
                raise ValueError(f"corrupt batch layout: {name} is {dtype}, not one {want} a row")
        for name, _, count, _, shape in arrays:
            if (count if shape is None else shape[0]) != rows:
                raise ValueError(f"corrupt batch layout: {name!r} is not {rows} rows")
        sources, version = header.get("sources"), header.get("recipe_version")
        digest = header.get("recipe_digest")
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise ValueError(f"corrupt batch layout: sources {sources!r}")
        if type(version) is not int or not isinstance(digest, str | None):
            raise ValueError(f"corrupt batch layout: recipe version {version!r}, digest {digest!r}")
        return cls(tuple(arrays), tuple(sources), version, digest, base + size)


DTYPE = re.compile(
    r"[<>|](b1|[iu][1248]|f(2|4|8|12|16)|c(8|16|24|32)|[SU][1-9]\d{0,8}"
    r"|[mM]8(\[([1-9]\d{0,8})?(Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?)"
)
"""The dtypes an array may have on the wire, as ``dtype.str`` writes them: booleans,
numbers, fixed-width bytes and text, datetimes. A layout's dtype is matched against it
before numpy reads it (``np.dtype`` of an untrusted string may build an object,
structured or subarray dtype, or evaluate the string as a literal)."""
_ROW_DTYPES = (np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.int16))


def _spec(value: Any) -> list[Any]:
    """A row array's ``[dtype, shape, offset]``, or a ValueError."""
    if not isinstance(value, list):
        raise ValueError(f"corrupt batch layout: a row array is {value!r}")
    return value


def _array(
    spec: list[Any], base: int, pos: int, size: int
) -> tuple[str, np.dtype, int, int, tuple[int, ...] | None]:
    """An array's ``(name, dtype, count, offset, shape)`` of ``spec`` (``[name, dtype,
    shape, offset]``), checked: at or past ``pos`` (the previous array's end) and within
    ``size`` bytes of ``base``."""
    if len(spec) != 4:
        raise ValueError(
            f"corrupt batch layout: array {spec!r} is not [name, dtype, shape, offset]"
        )
    name, dtype_str, shape, off = spec
    if not isinstance(name, str):
        raise ValueError(f"corrupt batch layout: array name {name!r}")
    if not isinstance(dtype_str, str) or DTYPE.fullmatch(dtype_str) is None:
        raise ValueError(f"corrupt batch layout: array {name!r} has dtype {dtype_str!r}")
    if not isinstance(shape, list) or not shape:
        raise ValueError(f"corrupt batch layout: array {name!r} has shape {shape!r}")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"corrupt batch: shape {shape} is not of non-negative integers")
    try:
        dtype = np.dtype(dtype_str)
    except TypeError:  # of the grammar but not of this platform (e.g. f12)
        raise ValueError(f"corrupt batch layout: array {name!r} has dtype {dtype_str!r}") from None
    count = math.prod(shape)  # exact (np.prod wraps at 2**63): checked against the size
    if type(off) is not int or off < pos or off % ALIGN or off + count * dtype.itemsize > size:
        raise ValueError(f"corrupt batch: array {name!r} past the end of its layout or overlapping")
    return name, dtype, count, base + off, tuple(shape) if len(shape) != 1 else None


LAYOUT_COST = 320
"""Bytes a parsed layout holds per array, beyond its raw bytes (its tuples, names and
shapes: ~310 bytes an array with one field, ~235 with thirty, by ``sys.getsizeof``)."""


class WireLayouts:
    """Parsed layouts by their bytes (thread-safe): the ``kept`` most recently parsed, as
    long as they hold at most ``max_bytes`` together (each its raw bytes and
    :data:`LAYOUT_COST` an array); a layout bigger than that is parsed for every batch.
    Keyed by the whole layout, so a batch is read with the layout its own bytes give,
    whatever recipe or digest it names."""

    def __init__(self, kept: int = LAYOUTS_KEPT, max_bytes: int = LAYOUTS_BYTES) -> None:
        self.kept, self.max_bytes = kept, max_bytes
        self.nbytes = 0
        self._parsed: dict[bytes, tuple[WireLayout, int]] = {}
        self._lock = threading.Lock()

    def get(self, raw: bytes) -> WireLayout:
        """The layout of ``raw``, parsed on first sight."""
        found = self._parsed.get(raw)
        if found is not None:
            return found[0]
        layout = WireLayout.parse(raw)
        cost = len(raw) + LAYOUT_COST * len(layout.arrays)
        if cost > self.max_bytes:
            return layout
        with self._lock:
            if raw not in self._parsed:
                self._parsed[raw] = (layout, cost)
                self.nbytes += cost
            while len(self._parsed) > self.kept or self.nbytes > self.max_bytes:
                self.nbytes -= self._parsed.pop(next(iter(self._parsed)))[1]  # oldest first
        return layout

    def __len__(self) -> int:
        return len(self._parsed)


LAYOUTS = WireLayouts()
"""This process's parsed layouts (:func:`decode_batch`'s default)."""


def decode_batch(buf: Any, layouts: WireLayouts | None = LAYOUTS) -> Batch:
    """Decode a batch from any buffer (bytes, bytearray, memoryview, mmap) without copying arrays.

    The returned arrays are views of ``buf`` and keep it alive. ``layouts``: where parsed
    layouts are kept (None: parse this one's)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _VERSIONED.size:
        raise ValueError("not a Claw batch: too short")
    magic, version = _VERSIONED.unpack_from(mv)
    if magic != MAGIC:
        raise ValueError(f"not a Claw batch: bad magic {magic!r}")
    if version != VERSION:
        check_version(version)
    if len(mv) < _PREFIX.size:
        raise ValueError("truncated batch: prefix past end of buffer")
    _, _, head_len, tail_len = _PREFIX.unpack_from(mv)
    if _PREFIX.size + head_len > len(mv):
        raise ValueError("truncated batch: layout past end of buffer")
    raw = mv[_PREFIX.size : _PREFIX.size + head_len].tobytes()
    layout = WireLayout.parse(raw) if layouts is None else layouts.get(raw)
    end = layout.end
    if end + tail_len > len(mv):
        raise ValueError("truncated batch: array body past end of buffer")
    # one constructor call an array, its shape given (a frombuffer and a reshape cost
    # twice as much); the layout's checks keep every array within ``mv``
    views = [
        np.ndarray(shape or (count,), dtype, mv, off)
        for _, dtype, count, off, shape in layout.arrays
    ]
    tail = msgpack.unpackb(mv[end : end + tail_len], raw=False) if tail_len else {}
    if not isinstance(tail, dict):
        raise ValueError(f"corrupt batch tail: {type(tail).__name__}, not a map")
    meta, seed = tail.get("meta", {}), tail.get("seed")
    if not isinstance(meta, dict) or not (seed is None or type(seed) is int):
        raise ValueError(f"corrupt batch tail: meta of {type(meta).__name__}, seed {seed!r}")
    n_fields = len(views) - len(_RESERVED)
    return Batch(
        fields={a[0]: v for a, v in zip(layout.arrays[:n_fields], views, strict=False)},
        ids=views[-3],
        weights=views[-2],
        source_index=views[-1],
        sources=layout.sources,
        recipe_version=layout.recipe_version,
        meta=meta,
        claim=_claim(tail.get("claim")),
        seed=seed,
        recipe_digest=layout.recipe_digest,
    )


def _claim(c: Any) -> Claim | None:
    """A tail's ``claim`` (``[pass, token, ids]``), checked."""
    if c is None:
        return None
    if not (
        isinstance(c, list)
        and len(c) == 3
        and type(c[0]) is int
        and isinstance(c[1], str)
        and isinstance(c[2], list)
        and all(isinstance(i, str) for i in c[2])
    ):
        raise ValueError(f"corrupt batch tail: claim {c!r}"[:200])
    return Claim(c[0], c[1], tuple(c[2]))

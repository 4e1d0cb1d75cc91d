"""The lineage log's index: the entries that trained a policy, and the policies that trained
a step, without reading the whole log.

The trainer's append stays one ``XADD`` on its next pop's pipeline (:mod:`orchestrator.
delivery.lineage`): nothing is added to its path. A pass (the beat task
``claw.maintenance.lineage``, :meth:`LineageIndex.build`) indexes the entries after the
index's watermark in *segments* of up to ``SEGMENT`` entries, each one hash
``claw:{ns}:lineage:seg:<first stream id>``:

- ``m``: msgpack: the first and last stream ids, the entry count, the block ``bits``, the
  policy table (``[text, batches]`` in code order) and the recipe versions its entries
  name (``recipes``: their digests, which the registry keeps while a segment names them);
- ``pol``: each entry's policy code (u1/u2/u4 by the table's size);
- ``sid``: each entry's stream id (two u8: ms, seq), so a query reads just its entries;
- ``b:<block>``: every row of the segment's entries whose step id lies in ``[block << bits,
  (block + 1) << bits)``, sorted by id: the gaps between the ids (the first from the block's
  start) and then the rows' entry numbers, each at the narrowest width that holds it, zstd
  over both. ``bits`` is chosen per segment so a block holds about ``BLOCK_ROWS`` rows
  however the ids spread (uniform over a 1M ring, or a recent window).

``claw:{ns}:lineage:segs`` (a sorted set: first stream id, scored by its last's ms) lists the
segments and ``claw:{ns}:lineage:wm`` holds the last stream id indexed; a pass writes a
segment, the set and the watermark in one ``MULTI``/``EXEC`` watched on the watermark, so two
passes never index an entry twice. Retention is the log's: a pass drops the segments whose
entries the log has all trimmed, and a query skips the trimmed entries of the oldest
segment (trimming goes oldest first: only that one can be partial).

A query reads the segments' tables (one pipelined round trip), then only what it needs of
them — the blocks of the step ids asked for, or a policy's entries by stream id — and scans
the tail after the watermark (what arrived since the last pass: fewer than
``MIN_SEGMENT`` entries, or ``LAG_S`` seconds of them). Costs: docs/benchmarks.md,
"Lineage".
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import zstandard

from claw_tasks.format.arrays import packb, unpackb

SEGMENT = 8_192
"""Entries per segment at most (entry numbers fit two bytes)."""
MIN_SEGMENT = 1_024
"""A pass leaves a tail shorter than this for the next one (queries scan it) ..."""
LAG_S = 300.0
"""... unless its oldest entry is older than this."""
BLOCK_ROWS = 4_096
"""Rows a block holds, about: a step query reads one block per segment."""
_WIDTHS = (np.dtype("u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))
_SID = np.dtype([("ms", "<u8"), ("seq", "<u8")])


def encode_ids(ids: np.ndarray) -> bytes:
    """Step ids, sorted (repeats kept): a width byte, the first id (8 bytes), the gaps at
    the narrowest width that holds the largest (an entry's ``ids``)."""
    return encode_sorted(np.sort(np.asarray(ids, np.int64)))


def encode_sorted(s: np.ndarray) -> bytes:
    """:func:`encode_ids` of ids already sorted (int64)."""
    if not len(s):
        return b""
    gaps = np.diff(s)
    width = narrowest(int(gaps.max()) if len(gaps) else 0)
    return bytes([width.itemsize]) + s[:1].astype("<i8").tobytes() + gaps.astype(width).tobytes()


def decode_ids(raw: bytes) -> np.ndarray:
    """The sorted ids of :func:`encode_ids`."""
    if not raw:
        return np.zeros(0, np.int64)
    width = next((w for w in _WIDTHS if w.itemsize == raw[0]), _WIDTHS[-1])
    first = np.frombuffer(raw, "<i8", 1, 1)
    gaps = np.frombuffer(raw, width, offset=9).astype(np.int64)
    return np.concatenate([first, first[0] + np.cumsum(gaps)])


def narrowest(top: int) -> np.dtype:
    """The narrowest unsigned dtype holding ``0..top``."""
    return next(w for w in _WIDTHS if top < 2 ** (8 * w.itemsize))


def parse_sid(sid: bytes | str) -> tuple[int, int]:
    """A stream id ``ms-seq`` as a pair (orderable)."""
    text = sid.decode() if isinstance(sid, bytes) else sid
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_sid(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


@dataclass(frozen=True)
class Segment:
    """One indexed segment's table (its ``m`` and ``pol`` fields)."""

    key: str
    first: tuple[int, int]
    last: tuple[int, int]
    n: int
    bits: int
    policies: list[str]
    batches: list[int]
    pol: np.ndarray  # entry -> policy code
    recipes: tuple[str, ...] = ()  # the recipe versions (digests) its entries name

    def code(self, policy: str) -> int | None:
        try:
            return self.policies.index(policy)
        except ValueError:
            return None


@dataclass(frozen=True)
class Postings:
    """Rows of a segment's entries: step ids and entry numbers (parallel)."""

    ids: np.ndarray
    entries: np.ndarray


@dataclass
class BuildReport:
    """What one indexing pass did."""

    segments: int = 0  # written
    entries: int = 0  # indexed
    bytes: int = 0  # of the fields written
    dropped: int = 0  # segments dropped: every entry trimmed from the log
    seconds: float = 0.0


def encode_block(ids: np.ndarray, entries: np.ndarray, base: int, n_entries: int) -> bytes:
    """A block's field: widths byte pair, the count, the id gaps, the entry numbers."""
    gaps = np.diff(ids, prepend=base)
    gw, ew = narrowest(int(gaps.max()) if len(gaps) else 0), narrowest(max(n_entries - 1, 0))
    head = bytes([gw.itemsize, ew.itemsize]) + len(ids).to_bytes(4, "little")
    body = gaps.astype(gw).tobytes() + entries.astype(ew).tobytes()
    return head + zstandard.ZstdCompressor(level=1).compress(body)


def decode_block(raw: bytes, base: int) -> Postings:
    gw = next(w for w in _WIDTHS if w.itemsize == raw[0])
    ew = next(w for w in _WIDTHS if w.itemsize == raw[1])
    n = int.from_bytes(raw[2:6], "little")
    body = zstandard.ZstdDecompressor().decompress(raw[6:], max_output_size=n * 16)
    gaps = np.frombuffer(body, gw, n).astype(np.int64)
    entries = np.frombuffer(body, ew, n, offset=n * gw.itemsize).astype(np.int64)
    return Postings(base + np.cumsum(gaps), entries)


def choose_bits(ids: np.ndarray) -> int:
    """Block bits for a segment's sorted ids: about BLOCK_ROWS rows a block."""
    if not len(ids):
        return 0
    span = int(ids[-1] - ids[0]) + 1
    blocks = max(1, len(ids) // BLOCK_ROWS)
    return max(0, math.ceil(math.log2(max(1.0, span / blocks))))


class LineageIndex:
    """The index of one lineage stream ``key`` (see the module docstring)."""

    def __init__(
        self, r: redis.Redis, key: str, segment: int = SEGMENT, min_segment: int = MIN_SEGMENT
    ) -> None:
        self.r, self.stream = r, key
        self.segment, self.min_segment = min(segment, 65_536), min_segment
        self.segs = f"{key}:segs"
        self.wm = f"{key}:wm"

    def seg_key(self, first: str) -> str:
        return f"{self.stream}:seg:{first}"

    # ---- building -----------------------------------------------------------------
    def build(self, now: float | None = None, *, force: bool = False) -> BuildReport:
        """Index the entries after the watermark: whole segments (``segment`` entries), and
        the rest when it is ``min_segment`` entries or more, its oldest older than
        ``LAG_S``, or ``force``; then drop the segments the log has trimmed whole."""
        began = time.perf_counter()
        now = time.time() if now is None else now
        report = BuildReport()
        while True:
            wm = self.r.get(self.wm)
            low = "-" if wm is None else "(" + wm.decode()
            page = self.r.xrange(self.stream, low, "+", count=self.segment)
            if not page:
                break
            oldest_ms = parse_sid(page[0][0])[0]
            short = len(page) < self.segment
            young = now - oldest_ms / 1000 < LAG_S
            if short and not force and len(page) < self.min_segment and young:
                break
            written = self._write(page, wm)
            if written is None:  # another pass moved the watermark: read again from it
                continue
            report.segments += 1
            report.entries += len(page)
            report.bytes += written
            if short:
                break
        report.dropped = self._drop_trimmed()
        report.seconds = time.perf_counter() - began
        return report

    def _write(self, page: list[tuple[bytes, dict[bytes, bytes]]], wm: bytes | None) -> int | None:
        n = len(page)
        sids = np.array([parse_sid(i) for i, _ in page], _SID)
        table: dict[bytes, int] = {}
        pol = np.empty(n, np.int64)
        parts = []
        recipes = {kv[b"rd"] for _, kv in page if b"rd" in kv}
        for k, (_, kv) in enumerate(page):
            pol[k] = table.setdefault(kv.get(b"p", b""), len(table))
            try:
                parts.append(decode_ids(kv.get(b"ids", b"")))
            except (ValueError, IndexError):  # not a client's entry: indexed with no rows,
                parts.append(np.zeros(0, np.int64))  # so one bad entry never stops the pass
        lens = np.fromiter((len(p) for p in parts), np.int64, n)
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        owner = np.repeat(np.arange(n), lens)
        order = np.argsort(ids, kind="stable")
        ids, owner = ids[order], owner[order]
        bits = choose_bits(ids)
        blocks = ids >> bits
        cuts = np.flatnonzero(np.diff(blocks)) + 1
        fields: dict[str, bytes] = {}
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(ids)], strict=True):
            if hi > lo:
                b = int(blocks[lo])
                fields[f"b:{b}"] = encode_block(ids[lo:hi], owner[lo:hi], b << bits, n)
        batches = np.bincount(pol, minlength=len(table)).tolist()
        first, last = page[0][0].decode(), page[-1][0].decode()
        meta = {
            "first": first,
            "last": last,
            "n": n,
            "bits": bits,
            "policies": [p.decode(errors="replace") for p in table],
            "batches": batches,
            "recipes": sorted(r.decode(errors="replace") for r in recipes),
        }
        fields["m"] = packb(meta)
        fields["pol"] = pol.astype(narrowest(max(len(table) - 1, 0))).tobytes()
        fields["sid"] = sids.tobytes()
        key = self.seg_key(first)
        with self.r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.wm)
                if pipe.get(self.wm) != wm:
                    return None
                pipe.multi()
                pipe.hset(key, mapping=fields)  # type: ignore[arg-type]  # redis-py's stubs want str keys; bytes are sent as they are
                pipe.zadd(self.segs, {first: parse_sid(last)[0]})
                pipe.set(self.wm, last)
                pipe.execute()
            except redis.WatchError:
                return None
        return sum(len(v) for v in fields.values())

    def _drop_trimmed(self) -> int:
        """Drop the segments whose last entry the log no longer holds."""
        head = self.r.xrange(self.stream, "-", "+", count=1)
        if not head:
            stale = [m.decode() for m in self.r.zrange(self.segs, 0, -1)]
        else:
            first = parse_sid(head[0][0])
            candidates = self.r.zrangebyscore(self.segs, "-inf", first[0])
            stale = []
            for m in candidates:
                raw = self.r.hget(self.seg_key(m.decode()), "m")
                if raw is None or parse_sid(unpackb(raw)["last"]) < first:
                    stale.append(m.decode())
        if stale:
            with self.r.pipeline(transaction=True) as pipe:
                pipe.zrem(self.segs, *stale)
                pipe.unlink(*[self.seg_key(s) for s in stale])
                if not head:
                    pipe.delete(self.wm)
                pipe.execute()
        return len(stale)

    # ---- reading ------------------------------------------------------------------
    def state(self) -> tuple[list[Segment], str | None, tuple[int, int] | None]:
        """The segments (oldest first), the watermark, and the log's first stream id (None:
        empty), read consistently (two round trips)."""
        with self.r.pipeline(transaction=True) as pipe:
            pipe.zrange(self.segs, 0, -1)
            pipe.get(self.wm)
            pipe.xrange(self.stream, "-", "+", count=1)
            names, wm, head = pipe.execute()
        with self.r.pipeline(transaction=False) as pipe:
            for m in names:
                pipe.hmget(self.seg_key(m.decode()), ["m", "pol"])
            tables = pipe.execute()
        out = []
        for m, (raw, pol) in zip(names, tables, strict=True):
            if raw is None:  # dropped meanwhile (all its entries trimmed)
                continue
            meta = unpackb(raw)
            width = narrowest(max(len(meta["policies"]) - 1, 0))
            out.append(
                Segment(
                    self.seg_key(m.decode()),
                    parse_sid(meta["first"]),
                    parse_sid(meta["last"]),
                    meta["n"],
                    meta["bits"],
                    meta["policies"],
                    meta["batches"],
                    np.frombuffer(pol or b"", width).astype(np.int64),
                    tuple(meta.get("recipes", ())),
                )
            )
        out.sort(key=lambda s: s.first)
        first = parse_sid(head[0][0]) if head else None
        return out, None if wm is None else wm.decode(), first

    def sids(self, segments: Sequence[Segment]) -> list[np.ndarray]:
        """The stream ids of each segment's entries (one round trip)."""
        with self.r.pipeline(transaction=False) as pipe:
            for s in segments:
                pipe.hget(s.key, "sid")
            got = pipe.execute()
        return [np.frombuffer(raw or b"", _SID) for raw in got]

    def postings(self, segments: Sequence[Segment], ids: np.ndarray) -> list[Postings]:
        """Per segment, its rows holding one of ``ids`` (sorted, unique): the blocks those
        ids fall in, read in one round trip, filtered."""
        wanted: list[list[int]] = []
        with self.r.pipeline(transaction=False) as pipe:
            for s in segments:
                blocks = np.unique(ids >> s.bits).tolist()
                wanted.append(blocks)
                if blocks:
                    pipe.hmget(s.key, [f"b:{b}" for b in blocks])
            got = iter(pipe.execute())
        out = []
        for s, blocks in zip(segments, wanted, strict=True):
            raws = next(got) if blocks else []
            hit_ids, hit_entries = [], []
            for b, raw in zip(blocks, raws, strict=True):
                if raw is None:
                    continue
                p = decode_block(raw, b << s.bits)
                keep = np.isin(p.ids, ids)
                hit_ids.append(p.ids[keep])
                hit_entries.append(p.entries[keep])
            cat = np.concatenate
            out.append(
                Postings(
                    cat(hit_ids) if hit_ids else np.zeros(0, np.int64),
                    cat(hit_entries) if hit_entries else np.zeros(0, np.int64),
                )
            )
        return out

    def tail(self, wm: str | None, page_size: int) -> Iterator[list[tuple[bytes, Any]]]:
        """The log's entries after the watermark, a page at a time."""
        low = "-" if wm is None else "(" + wm
        while True:
            page = self.r.xrange(self.stream, low, "+", count=page_size)
            if page:
                yield page
            if len(page) < page_size:
                return
            low = "(" + page[-1][0].decode()

    def fetch(self, sids: np.ndarray, entries: np.ndarray) -> list[tuple[bytes, Any]]:
        """A segment's entries ``entries`` (sorted entry numbers; ``sids``: the segment's
        stream ids): each run of consecutive ones read by one ``XRANGE``, pipelined.
        Entries the log trimmed meanwhile are left out."""
        if not len(entries):
            return []
        cuts = np.flatnonzero(np.diff(entries) != 1) + 1
        starts = entries[np.concatenate([[0], cuts])]
        ends = entries[np.concatenate([cuts - 1, [len(entries) - 1]])]
        with self.r.pipeline(transaction=False) as pipe:
            for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
                a, b = sids[lo], sids[hi]
                pipe.xrange(
                    self.stream,
                    format_sid(int(a["ms"]), int(a["seq"])),
                    format_sid(int(b["ms"]), int(b["seq"])),
                )
            return [e for page in pipe.execute() for e in page]

"""The ``delta`` codec's frames: key frames and deltas to a key frame.

A key frame is ``b"K"`` + the step's own id (i64 LE) + a zstd frame of the row; a delta
is ``b"D"`` + its key frame's step id + a zstd frame of the row XOR the key's row (a
bitwise difference: exact for every dtype, mostly zero bytes between similar frames).
A self-contained copy that is no step's own frame (an explicit ``next_obs``) is a key
frame with id 0 (step ids start at 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from claw_tasks.codecs.engines import engine_for
from claw_tasks.codecs.errors import CodecError

KEY, DELTA = b"K", b"D"


class KeyFrameGone(CodecError):
    """A delta's key frame was not where its id says: its slot was reused between the
    read of the delta and the read of the key (the ring passed both); read again."""


HEADER = 9


def key_frame(body: bytes, own_id: int) -> bytes:
    return KEY + own_id.to_bytes(8, "little", signed=True) + body


def delta_frame(body: bytes, key_id: int) -> bytes:
    return DELTA + key_id.to_bytes(8, "little", signed=True) + body


def kind(frame: bytes | memoryview) -> tuple[bytes, int]:
    """(``KEY`` or ``DELTA``, the id in the header); CodecError when malformed."""
    if len(frame) < HEADER or bytes(frame[:1]) not in (KEY, DELTA):
        raise CodecError("delta frame without its 9-byte header (K|D, i64 id)")
    return bytes(frame[:1]), int.from_bytes(bytes(frame[1:HEADER]), "little", signed=True)


def key_body(frame: bytes | memoryview) -> memoryview:
    """The zstd frame of a key frame (CodecError for a delta: it needs its key)."""
    k, _ = kind(frame)
    if k != KEY:
        raise CodecError("a delta frame needs its key frame to decode")
    return memoryview(frame)[HEADER:]


def encode_groups(
    codec: Any, rows: np.ndarray, ids: np.ndarray, runs: list[np.ndarray]
) -> list[bytes]:
    """Frames of ``rows`` (raw, ``(n, ...)``) with step ``ids``: each run (the rows of one
    episode's consecutive steps, in step order) is cut into groups of ``key_every``; a
    group's last step is its key frame, every other step a delta to it. The key is the
    newest step of its group (the highest row: rows are committed in seq order, whatever
    their step order), so the ring (which overwrites oldest first) never takes a key
    before the deltas that need it."""
    n = len(rows)
    flat = np.ascontiguousarray(rows).reshape(n, -1).view(np.uint8).reshape(n, -1)
    key_of = np.arange(n)
    k = codec.key_every
    for run in runs:
        for lo in range(0, len(run), k):
            group = run[lo : lo + k]
            key_of[group] = group.max()
    eng = engine_for(codec)
    out = []
    for i in range(n):
        key = int(key_of[i])
        if key == i:
            out.append(key_frame(eng.encode(flat[i]), int(ids[i])))
        else:
            out.append(delta_frame(eng.encode(flat[i] ^ flat[key]), int(ids[key])))
    return out


def needed_keys(frames: list[Any]) -> set[int]:
    """Step ids of the key frames the deltas among ``frames`` need (none present there)."""
    have, need = set(), set()
    for f in frames:
        if f:
            k, i = kind(f)
            (have if k == KEY else need).add(i)
    return need - have - {0}


def decode_with_keys(
    codec: Any, frames: list[Any], keys: dict[int, Any], dtype: Any, shape: tuple[int, ...]
) -> np.ndarray:
    """Rows of delta-codec ``frames`` (empty: zeros), ``keys`` holding the key frames by
    step id that are not among them. A key frame that is gone or is another step's raises
    CodecError (the store's design keeps keys while their deltas live)."""
    eng = engine_for(codec)
    dt = np.dtype(dtype)
    nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    out = np.zeros((len(frames), nbytes), np.uint8)
    raw: dict[int, np.ndarray] = {}

    def key_row(i: int, frame: Any) -> np.ndarray:
        if i not in raw:
            if not frame:
                raise KeyFrameGone(f"the key frame of step {i} is gone")
            k, own = kind(frame)
            if k != KEY or own != i:
                raise KeyFrameGone(f"the key frame of step {i} was replaced (step {own} holds it)")
            raw[i] = np.frombuffer(eng.decode(key_body(frame), nbytes, shape), np.uint8)
        return raw[i]

    heads = [kind(f) if f else None for f in frames]
    present: dict[int, Any] = {}  # key frames among ``frames`` by their step id (one pass)
    for f, head in zip(frames, heads, strict=True):
        if head is not None and head[0] == KEY and head[1] > 0:
            present.setdefault(head[1], f)
    for j, f in enumerate(frames):
        if heads[j] is None:
            continue
        k, i = heads[j]  # type: ignore[misc]  # None skipped above (a list item is not narrowed)
        if k == KEY and i > 0:  # a step's own key frame: maybe another row's key too
            out[j] = key_row(i, f)
        elif k == KEY:  # a self-contained copy (explicit next_obs): id 0
            out[j] = np.frombuffer(eng.decode(key_body(f), nbytes, shape), np.uint8)
        else:
            found = present.get(i, keys.get(i))
            body = np.frombuffer(eng.decode(memoryview(f)[HEADER:], nbytes, shape), np.uint8)
            out[j] = body ^ key_row(i, found)
    return out.view(dt).reshape(len(frames), *shape)

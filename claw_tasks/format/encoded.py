"""``Encoded``: a compressed field's rows as frames, as a batch carries them from a producer
that compresses (or from an archive that kept the stored bytes), with the checks an ingest
worker makes on them before anything is stored."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.codecs import Codec, CodecError, CodecFrames, engine_for, frame_problem
from claw_tasks.codecs.delta import key_body
from claw_tasks.format.arrays import MAX_NDIM, check_dtype, pack_array
from claw_tasks.format.schema import FieldSpec

MSG_KEYS = frozenset({"codec", "dtype", "row", "data", "offsets"})


@dataclass
class Encoded:
    """A compressed field's rows as frames of its codec (encoded by the producer, or read
    back as stored by an archive): ``dtype`` and ``shape`` (``(n, *row)``, ``None`` first
    in ``row`` for a ragged field) are the decoded rows'. A frame from a producer is
    checked (:meth:`problems`) before it is stored."""

    codec: Codec
    dtype: np.dtype
    shape: tuple[int | None, ...]
    frames: CodecFrames
    # Rows a delta field's check decoded (uint8, one row each; never sent): the commit
    # makes the delta frames from them instead of decoding the frames a second time.
    decoded: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def spec(self) -> FieldSpec:
        return FieldSpec(self.dtype.str, tuple(self.shape[1:]), self.codec)

    def take(self, pos: np.ndarray) -> Encoded:
        decoded = None if self.decoded is None else self.decoded[pos]
        shape = (len(pos), *self.shape[1:])
        return Encoded(self.codec, self.dtype, shape, self.frames.take(pos), decoded)

    def declared(self) -> np.ndarray:
        """Decoded bytes each frame's header declares (-1: no readable header)."""
        eng = engine_for(self.codec)
        out = np.full(len(self), -1, np.int64)
        for i, f in enumerate(self.frames):
            with contextlib.suppress(CodecError):
                out[i] = eng.declared(key_body(f) if self.codec.name == "delta" else f)
        return out

    def problems(self, max_step_bytes: int, verify: bool = True) -> dict[int, str]:
        """Rows whose frame is not one the field may hold: the header's decoded size must
        be the row's (``frame_problem``), and with ``verify`` it must decode to it."""
        spec = self.spec
        keep = verify and self.codec.name == "delta"  # fixed shape: the schema says so
        if keep:
            self.decoded = np.zeros((len(self), spec.row_bytes), np.uint8)
            eng = engine_for(self.codec)
        out = {}
        for i, f in enumerate(self.frames):
            problem = frame_problem(spec.codec, f, self.dtype, spec.shape, max_step_bytes, not keep)
            if problem is None and keep:
                try:
                    row = eng.decode(key_body(f), spec.row_bytes, spec.shape)  # type: ignore[arg-type]  # a compressed field's shape is fixed (no None)
                    self.decoded[i] = np.frombuffer(row, np.uint8)  # type: ignore[index]  # decoded is a list once a frame is decoded
                except CodecError as e:
                    problem = f"{self.codec} frame: {e}"
            if problem is not None:
                out[i] = problem
        return out

    def to_msg(self) -> dict[str, Any]:
        """The msgpack form: codec, dtype, row shape, frames side by side and offsets."""
        return {
            "codec": str(self.codec),
            "dtype": self.dtype.str,
            "row": list(self.shape[1:]),
            "data": self.frames.data,
            "offsets": pack_array(self.frames.offsets, compress=False),
        }

    @classmethod
    def from_msg(cls, v: dict[str, Any], offsets: np.ndarray, name: str) -> Encoded:
        """From a producer's message (``offsets`` already unpacked): every part checked;
        the frames themselves are checked by :meth:`problems`."""
        if set(v) != MSG_KEYS:
            raise CodecError(
                f"field '{name}': a compressed field has codec, dtype, row, data and offsets only"
            )
        try:
            codec = Codec.of(v["codec"])
            dt = np.dtype(v["dtype"]) if isinstance(v["dtype"], str) else None
        except (TypeError, ValueError) as e:
            raise CodecError(f"field '{name}': {e}") from None
        if codec is None or dt is None:
            raise CodecError(f"field '{name}': compressed without a codec or dtype")
        check_dtype(dt, f"field '{name}'")
        row = v["row"]
        if not (
            isinstance(row, list)
            and len(row) < MAX_NDIM
            and all(type(x) is int and 0 <= x < 2**31 for x in row[1:])
            and (not row or row[0] is None or (type(row[0]) is int and 0 <= row[0] < 2**31))
        ):
            raise CodecError(f"field '{name}': row shape {row!r:.80}")
        data = v["data"]
        if not isinstance(data, bytes):
            raise CodecError(f"field '{name}': frames must be bytes")
        offsets = offsets.astype(np.int64)
        if (
            offsets.ndim != 1
            or len(offsets) < 1
            or offsets[0] != 0
            or offsets[-1] != len(data)
            or (len(offsets) > 1 and np.diff(offsets).min() < 0)
        ):
            raise CodecError(f"field '{name}': frame offsets do not cover the data in order")
        frames = CodecFrames(data, offsets)
        return cls(codec, dt, (len(frames), *row), frames)

"""Payload codecs: compressed fields, chosen per field in the schema.

``Codec.of("zstd:3")`` parses a codec; ``encode(codec, rows)`` gives the ``CodecFrames`` of a
batch of one field (one frame per row), ``decode(codec, frames, dtype, shape)`` the rows
back; ``frame_problem`` is the ingest worker's check of a producer's frame. Where each
step happens (producer or ingest worker, prefetch workers) and how frames are stored:
docs/architecture.md, "Compressed fields".
"""

from claw_tasks.codecs.engines import engine_for
from claw_tasks.codecs.errors import CodecError, lz4_inflate
from claw_tasks.codecs.frames import CodecFrames
from claw_tasks.codecs.rows import decode, encode, frame_problem
from claw_tasks.codecs.spec import LOSSLESS, LOSSY, NAMES, Codec, image_layout

__all__ = [
    "LOSSLESS",
    "LOSSY",
    "NAMES",
    "Codec",
    "CodecError",
    "CodecFrames",
    "decode",
    "encode",
    "engine_for",
    "frame_problem",
    "image_layout",
    "lz4_inflate",
]

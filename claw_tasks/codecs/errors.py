"""The error every decoder raises on bytes that do not decode, and the one lz4 decoder (of
message array frames and of compressed fields alike). The bottom of the format: nothing of
Claw's imported."""

from __future__ import annotations

import lz4.block


class CodecError(ValueError):
    """A value cannot be framed or a frame is malformed."""


def lz4_inflate(frame: bytes | memoryview, nbytes: int) -> bytes:
    """An lz4 block frame (python-lz4's ``store_size``) whose declared size the caller
    checked to be ``nbytes``, decompressed: the one lz4 decoder of message frames and of
    compressed fields."""
    try:
        out = lz4.block.decompress(frame)
    except lz4.block.LZ4BlockError as e:
        raise CodecError(f"lz4 frame does not decode: {e}") from None
    if len(out) != nbytes:
        raise CodecError(f"lz4 frame decodes to {len(out)} bytes, not {nbytes}")
    return out

"""The pipes between a trainer and its read-ahead process: frames
``<u32 length><u8 kind><payload>``, payloads msgpack or a queue item's own bytes (never
pickle), and what each kind means (:mod:`orchestrator.delivery.readahead_process` has
the protocol)."""

from __future__ import annotations

import os
import select
import struct
import time

HEAD = struct.Struct("<IB")
# child -> trainer
ITEM, ERROR, FLUSHED = 0, 1, 2
# trainer -> child
CONFIG, USED, LINEAGE, RECIPE, FLUSH = 10, 11, 12, 13, 14
GEN = struct.Struct("<I")  # an item's generation: the recipe target it was popped for
MAX_FRAME = 1 << 31  # a frame's length field: a batch is far smaller
PIPE_BYTES = 1 << 20  # asked for the item pipe (Linux caps it at pipe-max-size)
WAKE = 0.5  # the child's longest wait on an empty queue before it looks for a stop


class ReadAheadProcessError(RuntimeError):
    """The read-ahead process failed (its error is in the message) or exited."""


def frame(kind: int, payload: bytes | bytearray) -> bytes:
    """One frame of ``kind``."""
    return HEAD.pack(len(payload), kind) + payload


class Frames:
    """Frames read from a pipe, with a timeout and a non-blocking drain (``poll``, not
    ``select``: a trainer's descriptors may be past 1,024)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        # read into: a read of up to PIPE_BYTES into a new bytes object costs ~25 us more
        # (the allocation of PIPE_BYTES and its release), whatever the pipe holds
        self._chunk = bytearray(PIPE_BYTES)
        self.eof = False
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def _parse(self) -> tuple[int, bytearray] | None:
        if len(self.buf) < HEAD.size:
            return None
        n, kind = HEAD.unpack_from(self.buf)
        if n >= MAX_FRAME:
            raise ReadAheadProcessError(f"a corrupt frame from the read-ahead pipe ({n} bytes)")
        if len(self.buf) < HEAD.size + n:
            return None
        # one copy, writable: a batch decoded from it gives writable views (a trainer's
        # tensors wrap them without another copy)
        payload = bytearray(memoryview(self.buf)[HEAD.size : HEAD.size + n])
        del self.buf[: HEAD.size + n]
        return kind, payload

    def _fill(self, timeout: float | None) -> bool:
        """Read what the pipe holds (waiting up to ``timeout`` for something); False on a
        timeout or at end of file."""
        if self.eof:
            return False
        if not self._poll.poll(None if timeout is None else int(timeout * 1000)):
            return False
        n = os.readv(self.fd, [self._chunk])
        if not n:
            self.eof = True
            return False
        self.buf += memoryview(self._chunk)[:n]
        return True

    def next(self, timeout: float | None) -> tuple[int, bytearray] | None:
        """The next frame; None after ``timeout`` seconds (or at end of file)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (got := self._parse()) is None:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not self._fill(left) and (self.eof or left == 0.0):
                return None
        return got

    def has_frame(self) -> bool:
        """Whether a complete frame is buffered already (no read)."""
        if len(self.buf) < HEAD.size:
            return False
        return len(self.buf) >= HEAD.size + HEAD.unpack_from(self.buf)[0]

    def ready(self) -> int:
        """Complete frames readable now (reads what the pipe holds without waiting)."""
        while self._fill(0):
            pass
        count, at = 0, 0
        while at + HEAD.size <= len(self.buf):
            n, _ = HEAD.unpack_from(self.buf, at)
            if at + HEAD.size + n > len(self.buf):
                break
            count, at = count + 1, at + HEAD.size + n
        return count

"""The pipes between a trainer and its read-ahead process: frames
``<u32 length><u8 kind><payload>``, payloads msgpack or a queue item's own bytes (never
pickle), and what each kind means (:mod:`orchestrator.delivery.readahead_process` has
the protocol)."""

from __future__ import annotations

import collections
import os
import select
import struct
import time

HEAD = struct.Struct("<IB")
# child -> trainer
ITEM, ERROR, FLUSHED = 0, 1, 2
# trainer -> child
CONFIG, USED, LINEAGE, RECIPE, FLUSH = 10, 11, 12, 13, 14
ITEM_HEAD = struct.Struct("<I?3x")
"""An item's head: its generation (the recipe target it was popped for) and whether the
child, once it held this item, had no room for another (it then waits for the trainer's
report of what it took); 8 bytes, so the item's arrays keep their alignment."""
MAX_FRAME = 1 << 31  # a frame's length field: a batch is far smaller
PIPE_BYTES = 1 << 20  # asked for the item pipe (Linux caps it at pipe-max-size)
WAKE = 0.5  # the child's longest wait on an empty queue before it looks for a stop
CREDIT_EVERY = 4
"""Items the trainer takes between two reports of its count to the child (sooner when it
finds none to take): each report is a write that wakes the child (~30 us of the
trainer's CPU), so the child may hold ``CREDIT_EVERY - 1`` items past its ``count``, the
ones taken and not yet reported: the trainer still holds ``count`` when the child stops."""


class ReadAheadProcessError(RuntimeError):
    """The read-ahead process failed (its error is in the message) or exited."""


def frame(kind: int, payload: bytes | bytearray) -> bytes:
    """One frame of ``kind``."""
    return HEAD.pack(len(payload), kind) + payload


class Frames:
    """Frames read from a pipe, with a timeout and a non-blocking drain. The descriptor is
    made non-blocking: a read is tried first and the pipe polled (``poll``, not
    ``select``: a trainer's descriptors may be past 1,024) only when it holds nothing, so
    taking a frame the pipe already holds is one system call, and one buffered none."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.parsed: collections.deque[tuple[int, bytearray]] = collections.deque()
        self._partial = bytearray()  # the start of a frame not yet read whole
        # read into: a read of up to PIPE_BYTES into a new bytes object costs ~25 us more
        # (the allocation of PIPE_BYTES and its release), whatever the pipe holds
        self._chunk = bytearray(PIPE_BYTES)
        self.eof = False
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def _split(self, data: memoryview) -> None:
        """Queue the whole frames of ``data`` (the partial frame before it first); keep
        the rest. Each payload is one copy, writable: a batch decoded from it gives
        writable views (a trainer's tensors wrap them without another copy), never
        overwritten by later reads."""
        partial = self._partial
        joined = bool(partial)
        if joined:
            partial += data
            data = memoryview(partial)
        at, end = 0, len(data)
        while end - at >= HEAD.size:
            n, kind = HEAD.unpack_from(data, at)
            if n >= MAX_FRAME:
                raise ReadAheadProcessError(f"a corrupt frame from the read-ahead pipe ({n} bytes)")
            if end - at - HEAD.size < n:
                break
            self.parsed.append((kind, bytearray(data[at + HEAD.size : at + HEAD.size + n])))
            at += HEAD.size + n
        if joined:  # a frame longer than a read is appended to, never copied whole again
            data.release()
            del partial[:at]
        else:
            partial[:] = data[at:]

    def _fill(self, timeout: float | None) -> bool:
        """Read what the pipe holds (waiting up to ``timeout`` for something when it holds
        nothing); False on a timeout or at end of file."""
        if self.eof:
            return False
        try:
            n = os.readv(self.fd, [self._chunk])
        except BlockingIOError:
            if timeout == 0 or not self._poll.poll(
                None if timeout is None else int(timeout * 1000)
            ):
                return False
            try:
                n = os.readv(self.fd, [self._chunk])
            except BlockingIOError:  # woken for nothing: the caller's loop waits again
                return True
        if not n:
            self.eof = True
            return False
        self._split(memoryview(self._chunk)[:n])
        return True

    def next(self, timeout: float | None) -> tuple[int, bytearray] | None:
        """The next frame; None after ``timeout`` seconds (or at end of file)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.parsed:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not self._fill(left) and (self.eof or left == 0.0):
                return None
        return self.parsed.popleft()

    def unread(self, frames: list[tuple[int, bytearray]]) -> None:
        """Put ``frames`` back in front, in their order (read again first)."""
        self.parsed.extendleft(reversed(frames))

    def ready(self) -> int:
        """Complete frames readable now (reads what the pipe holds without waiting)."""
        while self._fill(0):
            pass
        return len(self.parsed)

"""``ProcessReadAhead``: a recipe's batches read ahead by a child process, off the GIL.

A read-ahead thread (:class:`~orchestrator.delivery.readahead.ReadAhead`) hides the Redis
round trip of a pop, but its Python (the pipelined pop, refill requests, the lineage
entries' encoding and ``XADD``s) runs under the trainer's GIL: in a one-core Python
trainer such as SB3's DQN every CPU second of it is a second of wall time, and the GIL
hand-offs it causes cost the trainer's thread more again (docs/benchmarks.md, "SB3 DQN").
Here a child process (``python -m orchestrator.delivery.readahead_child``) does all the
Redis work: it keeps ``count`` raw queue items (to ``count + CREDIT_EVERY - 1``, below;
a few bytes each when the batch waits in ``/dev/shm``) in a pipe, and writes the lineage
entries the trainer declares. The trainer's :meth:`pop` reads one item, maps and decodes
it (:meth:`BatchClient.accept`: zero-copy for a shared-memory batch) and converts it;
:meth:`trained` encodes an entry and writes it to a pipe. No thread of the trainer's
process is involved.

The trainer tells the child how many items it took every
:data:`~orchestrator.delivery.readahead_pipe.CREDIT_EVERY` items (a write wakes the
child: ~30 us of the trainer's CPU, so not one a pop), and sooner when the child waits
for it: each item says whether the child had room left after it, so a pop that finds no
item behind a full child, or a trainer left with fewer than ``count`` by a byte budget,
reports at once (a pop that finds none behind a child with room waits 50 ms first: the
child is popping, or waiting on Redis, and a report would not give it an item sooner).

The lineage entries go into a pipe of their own that the child reads only when a
report, a flush or the end of its input wakes it: a write to it costs the trainer a
system call and wakes no one, and what a killed trainer declared is still in it when
the child sees its input end.

The pipes carry frames ``<u32 length><u8 kind><payload>``; payloads are msgpack or the
queue item's own bytes, never pickle. The child exits when its input pipe closes (the
trainer closed it, or died), writing the lineage it holds first; it ignores SIGINT, so a
Ctrl-C stops the trainer, whose exit then ends the child.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from claw_tasks.settings import get_settings
from orchestrator.delivery import shm
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import Traced
from orchestrator.delivery.readahead_pipe import (
    CONFIG,
    CREDIT_EVERY,
    ERROR,
    FLUSH,
    FLUSHED,
    ITEM,
    ITEM_HEAD,
    LINEAGE,
    PIPE_BYTES,
    RECIPE,
    USED,
    WAKE,
    Frames,
    ReadAheadProcessError,
    frame,
)
from orchestrator.sampling.batch import Batch

__all__ = ["ProcessReadAhead", "ReadAheadProcessError"]

log = logging.getLogger(__name__)

_UNREPORTED_WAIT = 0.05
"""Seconds a pop that finds no item waits before it reports takes the child did not
wait for (the last item said it had room: it is popping, or waiting on Redis)."""


def _close_end(end: list[int]) -> None:
    """Close the pipe end ``end`` holds and mark it closed."""
    fd, end[0] = end[0], -1
    os.close(fd)


class ProcessReadAhead:
    """Keeps up to ``count`` batches (and ``max_bytes``; always at least one) of recipe
    ``name`` popped by a child process.

    ``client`` is the trainer's :class:`~orchestrator.delivery.client.BatchClient`: the
    child opens its own to the same store and broker; the trainer's decodes the items
    (:meth:`BatchClient.accept`: stale or unreadable ones are dropped as a pop drops
    them) and explains an empty queue. With ``convert``, :meth:`pop` returns
    ``convert(batch)``. The interface is :class:`~orchestrator.delivery.readahead.
    ReadAhead`'s, plus :meth:`retarget` and :meth:`park`: the same child reads another
    recipe from then on (starting one costs ~1 s of imports, which an adapter re-sizing
    its recipe would otherwise wait for each time). ``name`` None starts the child idle,
    ahead of need."""

    def __init__(
        self,
        client: BatchClient,
        name: str | None,
        *,
        count: int = 8,
        max_bytes: int = 64 << 20,
        convert: Callable[[Batch], Any] | None = None,
    ) -> None:
        if count < 1 or max_bytes < 1:
            raise ValueError(
                f"read-ahead needs count >= 1 and max_bytes >= 1, got {count}, {max_bytes}"
            )
        self.name, self.count, self.max_bytes, self.convert = name, count, max_bytes, convert
        self._gen = 0  # items of other generations were popped for an earlier target
        self._taken = self._reported = 0  # items of this generation taken; told the child
        self._full = False  # whether the child had no room after the last item taken
        self._flushes = 0
        self._error: ReadAheadProcessError | None = None  # raised by every later call
        self._closed = False
        self._owner = os.getpid()  # a forked copy must not read or close the trainer's
        self._client = client
        self._lineage: list[list[Any]] = []  # sent with the next credits
        self._lock = threading.Lock()  # trained() may come from another thread
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the trainer's imports
        settings = get_settings()
        # the lineage pipe: entries wait in it, unread until the child's next report, flush
        # or end of input (no write to it wakes the child); a killed trainer's are in it
        lineage_in, lineage_out = os.pipe()
        os.set_blocking(lineage_out, False)  # full: the entry goes with the report
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(lineage_out, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.delivery.readahead_child"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                close_fds=True,
                pass_fds=(lineage_in,),
                start_new_session=True,  # a Ctrl-C (or Jupyter's interrupt) is the trainer's
            )
        except BaseException:
            os.close(lineage_out)
            raise
        finally:
            os.close(lineage_in)
        # at most once: by close(), or when this object goes without one
        self._lineage_out = [lineage_out]  # -1 once closed: its number may be reused
        self._close_lineage = weakref.finalize(self, _close_end, self._lineage_out)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out = self._proc.stdin.fileno()
        with contextlib.suppress(OSError, AttributeError):  # a larger pipe: Linux only
            fcntl.fcntl(self._proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._frames = Frames(self._proc.stdout.fileno())
        config = {
            "namespace": client.namespace,
            # resolved here: the child's environment may not name the trainer's servers
            # (the URLs, passwords included, travel in the pipe, never in argv)
            "redis_url": client.redis_url or settings.redis_url,
            "broker_url": client.broker_url or settings.broker_for(client.redis_url),
            "lineage_fd": lineage_in,
        }
        self._send(frame(CONFIG, msgpack.packb(config)) + self._target())

    @property
    def pid(self) -> int:
        """The child process's id."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        """Whether the child runs and has not failed (a dead one is not to be reused)."""
        return self._error is None and not self._closed and self._proc.poll() is None

    def _target(self) -> bytes:
        target = [self.name, self.count, self.max_bytes, self._gen]
        return frame(RECIPE, msgpack.packb(target))

    def retarget(
        self,
        name: str,
        count: int,
        convert: Callable[[Batch], Any] | None,
        max_bytes: int | None = None,
    ) -> None:
        """Read ahead recipe ``name`` from now on; what was read ahead of the old one is
        dropped (its shared-memory segments unlinked; its rows stay in the store)."""
        self._flush_entries()
        self.name, self.count, self.convert = name, count, convert
        self.max_bytes = self.max_bytes if max_bytes is None else max_bytes
        self._gen += 1
        self._taken = self._reported = 0
        self._send(self._target())

    def park(self) -> None:
        """Stop reading ahead (until :meth:`retarget`) and wait until the child has written
        what it held for the recipe (its pops' counters, the lineage): what an adapter does
        before it unregisters the recipe."""
        self._flush_entries()
        self.name, self._gen, self._taken, self._reported = None, self._gen + 1, 0, 0
        self._send(self._target())
        self.flush_lineage()

    def _send(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._out, view) :]
        except OSError:
            raise self._failed(self._gone()) from None

    def _failed(self, error: ReadAheadProcessError) -> ReadAheadProcessError:
        if self._error is None:
            self._error = error
        return self._error

    def _gone(self) -> ReadAheadProcessError:
        code = self._proc.poll()
        return ReadAheadProcessError(
            f"the read-ahead process of recipe {self.name!r} exited"
            + (f" with code {code}" if code is not None else "")
            + " (its error is on the trainer's stderr)"
        )

    def _frame_of(self, got: tuple[int, bytearray] | None) -> tuple[int, bytearray] | None:
        """``got``, after what an end of file or an error frame means (raised)."""
        if got is None:
            if self._frames.eof:
                raise self._failed(self._gone())
            return None
        if got[0] == ERROR:
            raise self._failed(
                ReadAheadProcessError(
                    f"the read-ahead process of recipe {self.name!r} failed: "
                    + got[1].decode(errors="replace")
                )
            )
        return got

    def pop(self, timeout: float | None = 30.0) -> Any:
        """The next batch (converted, with ``convert``); TimeoutError after ``timeout`` s,
        explaining why the recipe's queue stays empty."""
        if self._error is not None:
            raise self._error
        deadline = None if timeout is None else time.monotonic() + timeout
        frames = self._frames
        while True:
            got = frames.next(0)  # read already, or in the pipe: no wait, no poll
            if got is None and not frames.eof and self._taken > self._reported:
                # the child waits for a report if the last item it sent filled it (else
                # it waits on Redis: a report would only wake it); a short wait first
                # then, in case it filled up otherwise (a smaller count)
                if not self._full:
                    left = _UNREPORTED_WAIT
                    if deadline is not None:
                        left = max(min(left, deadline - time.monotonic()), 0.0)
                    got = frames.next(left)
                if got is None and not frames.eof:
                    self._report()
            if got is None and not frames.eof:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                got = frames.next(left)
            got = self._frame_of(got)
            if got is None:
                raise TimeoutError(self._client.why_empty(str(self.name), timeout))
            kind, payload = got
            if kind != ITEM:
                continue  # a late flush's acknowledgement
            item = memoryview(payload)[ITEM_HEAD.size :]
            if ITEM_HEAD.unpack_from(payload)[0] != self._gen:
                shm.discard(item)  # popped for the recipe before a retarget
                continue
            self._taken += 1
            self._full = bool(ITEM_HEAD.unpack_from(payload)[1])
            batch = self._client.accept(str(self.name), item)
            owed = self._taken - self._reported
            if (
                owed >= CREDIT_EVERY
                or (owed and self._child_waits(payload))
                or len(self._lineage) >= max(1, self.count // 4)
            ):
                self._report()
            if batch is None:
                continue
            return batch if self.convert is None else self.convert(batch)

    def _child_waits(self, taken: bytearray) -> bool:
        """Whether the child waits for a report while this process holds fewer than
        ``count`` items (held back by its byte budget): the newest item read (``taken``
        when none is left) says whether the child had room after it."""
        parsed = self._frames.parsed
        if len(parsed) >= self.count:
            return False
        kind, newest = parsed[-1] if parsed else (ITEM, taken)
        return kind != ITEM or bool(ITEM_HEAD.unpack_from(newest)[1])

    def _report(self) -> None:
        """:meth:`_give_credits`, a failure left to be raised by the next call (the batch
        in hand is served)."""
        with contextlib.suppress(ReadAheadProcessError):
            self._give_credits()

    def _give_credits(self) -> None:
        """Tell the child how many items of this generation were taken so far (it pops as
        many again while the trainer trains; a total, so a lost message is healed by the
        next), with the lineage entries declared since the last time."""
        with self._lock:
            entries, self._lineage = self._lineage, []
        data = frame(USED, msgpack.packb([self._gen, self._taken]))
        if entries:
            data += frame(LINEAGE, msgpack.packb(entries))
        try:
            self._send(data)
        except BaseException:
            with self._lock:
                self._lineage[:0] = entries
            raise
        self._reported = self._taken

    def trained(self, batch: Traced, policy_version: Any) -> None:
        """Record that ``batch`` (or a part of one this read-ahead served) trains
        ``policy_version``, written by the child. The entry goes into the lineage pipe at
        once (a write that wakes no one; the child reads the pipe at its next report,
        flush or end of input, so a killed trainer's entries are written too); one the
        pipe cannot take whole (full, or past ``PIPE_BUF`` bytes: a batch of more than
        ~280 rows) goes with the next pop's report, at most ``max(1, count // 4)``
        entries later."""
        ids = np.ascontiguousarray(batch.ids, "<i8").tobytes()
        entry = [self.name, int(batch.recipe_version), str(policy_version), ids, time.time()]
        weights = getattr(batch, "weights", None)  # what replays it (claw replay)
        source = getattr(batch, "source_index", None)
        entry += [
            None if weights is None else np.ascontiguousarray(weights, "<f4").tobytes(),
            getattr(batch, "seed", None),
            getattr(batch, "recipe_digest", None),
            None if source is None else np.ascontiguousarray(source, "<i2").tobytes(),
        ]
        data = frame(LINEAGE, msgpack.packb([entry]))
        with self._lock:
            # atomic up to PIPE_BUF bytes (a larger entry could be written in part), and
            # in order: behind entries waiting for the report, it waits too
            fd = self._lineage_out[0]
            if not self._lineage and fd >= 0 and len(data) <= select.PIPE_BUF:
                try:
                    os.write(fd, data)
                    return
                except OSError:  # full, or the child is gone: the report carries it
                    pass
            self._lineage.append(entry)

    def _flush_entries(self) -> None:
        """Send the entries declared so far (the child writes them with its next pop)."""
        with self._lock:
            entries, self._lineage = self._lineage, []
        if entries:
            try:
                self._send(frame(LINEAGE, msgpack.packb(entries)))
            except BaseException:
                with self._lock:
                    self._lineage[:0] = entries
                raise

    def flush_lineage(self, timeout: float = 10.0) -> None:
        """Have the child write the lineage entries declared so far (and its pops'
        counters), and wait for it: TimeoutError after ``timeout`` s."""
        self._flush_entries()
        self._flushes += 1
        self._send(frame(FLUSH, msgpack.packb(self._flushes)))
        deadline = time.monotonic() + timeout
        held = []
        try:
            while True:
                left = deadline - time.monotonic()
                got = self._frame_of(self._frames.next(max(left, 0.0)))
                if got is None:
                    raise TimeoutError(
                        f"the read-ahead process of recipe {self.name!r} did not write its "
                        f"lineage within {timeout} s"
                    )
                if got[0] == FLUSHED and msgpack.unpackb(got[1]) == self._flushes:
                    return
                if got[0] == ITEM:
                    held.append(got)
        finally:  # items read meanwhile are served next, in order
            self._frames.unread(held)

    def resize(self, count: int) -> None:
        """Keep up to ``count`` batches from now on."""
        if count < 1:
            raise ValueError(f"read-ahead needs count >= 1, got {count}")
        self.count = count
        self._send(self._target())

    def __len__(self) -> int:
        return self._frames.ready()

    def close(self) -> None:
        """Write the lineage declared, stop the child and reclaim the batches it held
        (their rows stay in the store). A forked copy only lets go of its descriptors."""
        if self._closed:
            return
        self._closed = True
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if os.getpid() != self._owner:
            for f in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):
                    f.close()
            with self._lock:
                self._close_lineage()
            return
        unsent = 0
        if self._proc.poll() is None:
            try:
                self._flush_entries()
            except ReadAheadProcessError:
                unsent = len(self._lineage)
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # end of file: the child writes its lineage, exits
            deadline = time.monotonic() + WAKE + 10
            while self._proc.poll() is None and time.monotonic() < deadline:
                self._discard(0.05)  # a child blocked writing to a full pipe exits too
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
                log.warning("read-ahead of %r: its process did not exit; killed", self.name)
        else:
            unsent = len(self._lineage)
        while self._discard(0):
            pass
        self._proc.stdout.close()
        with self._lock:
            self._close_lineage()
        if self._proc.returncode or unsent or self._error is not None:
            log.warning(
                "read-ahead of %r: its process ended with code %s%s%s",
                self.name,
                self._proc.returncode,
                f", {unsent} lineage entries not written" if unsent else "",
                f" ({self._error})" if self._error is not None else "",
            )

    def _discard(self, timeout: float) -> bool:
        """Reclaim one item the child popped for us (unlink its segment); False if none."""
        try:
            got = self._frames.next(timeout)
        except ReadAheadProcessError:
            return False
        if got is not None and got[0] == ITEM:
            shm.discard(memoryview(got[1])[ITEM_HEAD.size :])
        elif got is not None and got[0] == ERROR:
            self._failed(ReadAheadProcessError(got[1].decode(errors="replace")))
        return got is not None

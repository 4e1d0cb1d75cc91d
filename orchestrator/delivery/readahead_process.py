"""``ProcessReadAhead``: a recipe's batches read ahead by a child process, off the GIL.

A read-ahead thread (:class:`~orchestrator.delivery.readahead.ReadAhead`) hides the Redis
round trip of a pop, but its Python (the pipelined pop, refill requests, the lineage
entries' encoding and ``XADD``s) runs under the trainer's GIL: in a one-core Python
trainer such as SB3's DQN every CPU second of it is a second of wall time, and the GIL
hand-offs it causes cost the trainer's thread more again (docs/benchmarks.md, "SB3 DQN").
Here a child process (``python -m orchestrator.delivery.readahead_process``) does all the
Redis work: it keeps ``count`` raw queue items (a few bytes each when the batch waits in
``/dev/shm``) in a pipe, and takes the lineage entries the trainer declares from another
pipe and writes them. The trainer's :meth:`pop` reads one item, maps and decodes it
(:meth:`BatchClient.accept`: zero-copy for a shared-memory batch) and converts it;
:meth:`trained` appends a tuple. No thread of the trainer's process is involved.

The pipes carry frames ``<u32 length><u8 kind><payload>``; payloads are msgpack or the
queue item's own bytes, never pickle. The child exits when its input pipe closes (the
trainer closed it, or died), writing the lineage it holds first; it ignores SIGINT, so a
Ctrl-C stops the trainer, whose exit then ends the child.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from claw_tasks.settings import get_settings
from orchestrator.delivery import shm
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import Served, Traced
from orchestrator.sampling.batch import Batch

__all__ = ["ProcessReadAhead", "ReadAheadProcessError"]

_HEAD = struct.Struct("<IB")
# child -> trainer
_ITEM, _ERROR, _FLUSHED = 0, 1, 2
# trainer -> child
_CONFIG, _USED, _LINEAGE, _RECIPE, _FLUSH = 10, 11, 12, 13, 14
_GEN = struct.Struct("<I")  # an item's generation: the recipe target it was popped for
_MAX_FRAME = 1 << 31  # a frame's length field: a batch is far smaller
_PIPE_BYTES = 1 << 20  # asked for the item pipe (Linux caps it at pipe-max-size)
_WAKE = 0.5  # the child's longest wait on an empty queue before it looks for a stop


class ReadAheadProcessError(RuntimeError):
    """The read-ahead process failed (its error is in the message) or exited."""


def _frame(kind: int, payload: bytes) -> bytes:
    return _HEAD.pack(len(payload), kind) + payload


class _Frames:
    """Frames read from a pipe, with a timeout (select) and a non-blocking drain."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.eof = False

    def _parse(self) -> tuple[int, bytes] | None:
        if len(self.buf) < _HEAD.size:
            return None
        n, kind = _HEAD.unpack_from(self.buf)
        if len(self.buf) < _HEAD.size + n:
            return None
        payload = bytes(self.buf[_HEAD.size : _HEAD.size + n])
        del self.buf[: _HEAD.size + n]
        return kind, payload

    def _fill(self, timeout: float | None) -> bool:
        """Read what the pipe holds (waiting up to ``timeout`` for something); False on a
        timeout."""
        if self.eof:
            return False
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(self.fd, _PIPE_BYTES)
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def next(self, timeout: float | None) -> tuple[int, bytes] | None:
        """The next frame; None after ``timeout`` seconds (or at end of file)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (got := self._parse()) is None:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not self._fill(left) and (self.eof or left == 0.0):
                return None
        return got

    def ready(self) -> int:
        """Complete frames readable now (reads what the pipe holds without waiting)."""
        while self._fill(0):
            pass
        count, at = 0, 0
        while at + _HEAD.size <= len(self.buf):
            n, _ = _HEAD.unpack_from(self.buf, at)
            if at + _HEAD.size + n > len(self.buf):
                break
            count, at = count + 1, at + _HEAD.size + n
        return count


class ProcessReadAhead:
    """Keeps up to ``count`` batches of recipe ``name`` popped by a child process.

    ``client`` is the trainer's :class:`~orchestrator.delivery.client.BatchClient`: the
    child opens its own to the same store and broker; the trainer's decodes the items
    (:meth:`BatchClient.accept`: stale or unreadable ones are dropped as a pop drops
    them) and explains an empty queue. With ``convert``, :meth:`pop` returns
    ``convert(batch)``. The interface is :class:`~orchestrator.delivery.readahead.
    ReadAhead`'s, plus :meth:`retarget`: the same child reads another recipe from then on
    (starting one costs ~1 s of imports, which an adapter re-sizing its recipe would
    otherwise wait for each time)."""

    def __init__(
        self,
        client: Any,
        name: str | None,
        *,
        count: int = 8,
        convert: Callable[[Batch], Any] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"read-ahead needs count >= 1, got {count}")
        self.name, self.count, self.convert = name, count, convert
        self._gen = 0  # items of other generations were popped for an earlier target
        self._taken = 0  # items of this generation taken since the child got credits
        self._closed = False
        self._client = client
        self._lineage: list[list[Any]] = []  # sent with the next item taken
        self._lock = threading.Lock()  # trained() may come from another thread
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the trainer's imports
        settings = get_settings()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out = self._proc.stdin.fileno()
        with contextlib.suppress(OSError, AttributeError):  # a larger pipe: Linux only
            fcntl.fcntl(self._proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        self._frames = _Frames(self._proc.stdout.fileno())
        config = {
            "namespace": client.namespace,
            # resolved here: the child's environment may not name the trainer's servers
            # (the URLs, passwords included, travel in the pipe, never in argv)
            "redis_url": client.redis_url or settings.redis_url,
            "broker_url": client.broker_url or settings.broker_for(client.redis_url),
        }
        # None: started ahead of need (its imports overlap the trainer's start), idle
        # until :meth:`retarget`
        self._send(_frame(_CONFIG, msgpack.packb(config)) + (self._target() if name else b""))

    @property
    def pid(self) -> int:
        """The child process's id."""
        return self._proc.pid

    def _target(self) -> bytes:
        return _frame(_RECIPE, msgpack.packb([self.name, self.count, self._gen]))

    def retarget(self, name: str, count: int, convert: Callable[[Batch], Any] | None) -> None:
        """Read ahead recipe ``name`` from now on; what was read ahead of the old one is
        dropped (its shared-memory segments unlinked; its rows stay in the store)."""
        self._flush_entries()
        self.name, self.count, self.convert = name, count, convert
        self._gen += 1
        self._taken = 0
        self._send(self._target())

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._out, view) :]
        except (BrokenPipeError, OSError):
            raise self._gone() from None

    def _gone(self) -> ReadAheadProcessError:
        code = self._proc.poll()
        return ReadAheadProcessError(
            f"the read-ahead process of recipe {self.name!r} exited"
            + (f" with code {code}" if code is not None else "")
            + " (its error is on the trainer's stderr)"
        )

    def pop(self, timeout: float | None = 30.0) -> Any:
        """The next batch (converted, with ``convert``); TimeoutError after ``timeout`` s,
        explaining why the recipe's queue stays empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            got = self._frames.next(left)
            if got is None:
                if self._frames.eof:
                    raise self._gone()
                raise TimeoutError(self._client.why_empty(self.name, timeout))
            kind, payload = got
            if kind == _ERROR:
                raise ReadAheadProcessError(
                    f"the read-ahead process of recipe {self.name!r} failed: "
                    + payload.decode(errors="replace")
                )
            if kind != _ITEM:
                continue  # a flush's acknowledgement
            if _GEN.unpack_from(payload)[0] != self._gen:
                shm.discard(payload[_GEN.size :])  # popped for the recipe before retarget
                continue
            self._taken += 1
            if self._taken >= max(1, self.count // 4):  # a write wakes the child (~30 us):
                self._give_credits()  # one per few items taken, not one per item
            batch = self._client.accept(self.name, payload[_GEN.size :])
            if batch is None:
                continue
            return batch if self.convert is None else self.convert(batch)

    def _give_credits(self) -> None:
        """Tell the child it may pop as many items as were taken (it pops them while the
        trainer trains), with the lineage entries declared since the last time."""
        with self._lock:
            entries, self._lineage = self._lineage, []
        data = _frame(_USED, msgpack.packb(self._taken))
        if entries:
            data += _frame(_LINEAGE, msgpack.packb(entries))
        self._taken = 0
        self._send(data)

    def trained(self, batch: Traced, policy_version: Any) -> None:
        """Record that ``batch`` (or a part of one this read-ahead served) trains
        ``policy_version``: written by the child, sent to it with the next pop."""
        ids = np.ascontiguousarray(batch.ids, "<i8").tobytes()
        entry = [self.name, int(batch.recipe_version), str(policy_version), ids]
        with self._lock:
            self._lineage.append(entry)

    def _flush_entries(self) -> None:
        """Send the entries declared so far (the child writes them with its next pop)."""
        with self._lock:
            entries, self._lineage = self._lineage, []
        if entries:
            self._send(_frame(_LINEAGE, msgpack.packb(entries)))

    def flush_lineage(self, timeout: float = 10.0) -> None:
        """Have the child write the lineage entries declared so far, and wait for it."""
        self._flush_entries()
        self._send(_frame(_FLUSH, b""))
        deadline = time.monotonic() + timeout
        held = []
        while (left := deadline - time.monotonic()) > 0:
            got = self._frames.next(left)
            if got is None:
                break
            if got[0] == _FLUSHED:
                break
            held.append(got)
        # items read meanwhile are served next, in order
        self._frames.buf[:0] = b"".join(_frame(k, p) for k, p in held)

    def resize(self, count: int) -> None:
        """Keep up to ``count`` batches from now on."""
        if count < 1:
            raise ValueError(f"read-ahead needs count >= 1, got {count}")
        if self._taken:
            self._give_credits()  # first: the child counts what is in flight against it
        self.count = count
        self._send(self._target())

    def __len__(self) -> int:
        return self._frames.ready()

    def close(self) -> None:
        """Write the lineage declared, stop the child and reclaim the batches it held
        (their rows stay in the store)."""
        if self._closed:
            return
        self._closed = True
        if self._proc.poll() is None:
            with contextlib.suppress(ReadAheadProcessError):
                self._flush_entries()
            assert self._proc.stdin is not None
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # end of file: the child writes its lineage, exits
            deadline = time.monotonic() + _WAKE + 10
            while self._proc.poll() is None and time.monotonic() < deadline:
                self._discard(0.05)  # a child blocked writing to a full pipe exits too
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        while self._discard(0):
            pass
        assert self._proc.stdout is not None
        self._proc.stdout.close()

    def _discard(self, timeout: float) -> bool:
        """Reclaim one item the child popped for us (unlink its segment); False if none."""
        got = self._frames.next(timeout)
        if got is not None and got[0] == _ITEM:
            shm.discard(got[1][_GEN.size :])
        return got is not None


# ---- the child ------------------------------------------------------------------------
def _child() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's exit ends us
    out = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the frames
    frames = _Frames(0)
    got = frames.next(None)
    if got is None or got[0] != _CONFIG:
        return
    config = msgpack.unpackb(got[1])
    writing = threading.Lock()

    def write(kind: int, payload: bytes) -> None:
        with writing:
            data = _frame(kind, payload)
            view = memoryview(data)
            while view:
                view = view[os.write(out, view) :]

    try:
        client = BatchClient(
            config["namespace"], config["redis_url"], broker_url=config["broker_url"], readahead=0
        )
    except Exception as e:  # the trainer's first pop raises it
        write(_ERROR, f"{type(e).__name__}: {e}".encode())
        return
    room = threading.Condition()
    # the target: its recipe, the items it may still pop (credits) and its generation
    state: dict[str, Any] = {"name": None, "count": 0, "credits": 0, "gen": -1, "stop": False}

    def listen() -> None:
        """The trainer's frames: credits, lineage, resizes, flushes; end of file stops."""
        try:
            while (got := frames.next(None)) is not None:
                kind, payload = got
                if kind == _USED:
                    with room:
                        state["credits"] += int(msgpack.unpackb(payload))
                        room.notify()
                elif kind == _LINEAGE:
                    for recipe, version, policy, ids in msgpack.unpackb(payload):
                        served = Served(int(version), np.frombuffer(ids, "<i8"))
                        client.trained(recipe, served, policy)
                elif kind == _RECIPE:
                    recipe, count, gen = msgpack.unpackb(payload)
                    with room:  # a new count of the same target keeps what is in flight
                        held = state["count"] - state["credits"] if gen == state["gen"] else 0
                        state.update(name=recipe, count=count, gen=gen, credits=count - held)
                        room.notify()
                elif kind == _FLUSH:
                    client.flush_lineage()
                    write(_FLUSHED, b"")
        except Exception as e:  # reported to the trainer, then we stop
            with contextlib.suppress(OSError):
                write(_ERROR, f"{type(e).__name__}: {e}".encode())
        finally:
            with room:
                state["stop"] = True
                room.notify()

    listener = threading.Thread(target=listen, name="claw-readahead-listen", daemon=True)
    listener.start()
    try:
        while True:
            with room:
                while state["credits"] <= 0 and not state["stop"]:
                    room.wait()
                if state["stop"]:
                    break
                name, gen = state["name"], state["gen"]
            try:
                item = client.next_item(name, timeout=_WAKE, explain=False)
            except TimeoutError:
                continue  # the trainer's pop explains an empty queue itself
            with room:
                if gen == state["gen"]:
                    state["credits"] -= 1
            client.count_popped(name)
            write(_ITEM, _GEN.pack(gen) + bytes(item))
    except BrokenPipeError:
        pass  # the trainer is gone
    except Exception as e:  # the trainer's next pop raises it
        with contextlib.suppress(OSError):
            write(_ERROR, f"{type(e).__name__}: {e}".encode())
    finally:
        listener.join(timeout=1.0)
        client.close()  # writes the lineage still held


if __name__ == "__main__":
    _child()

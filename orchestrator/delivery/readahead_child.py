"""The read-ahead process (``python -m orchestrator.delivery.readahead_child``): pops its
trainer's recipe into a pipe and writes the lineage its trainer declares
(:mod:`orchestrator.delivery.readahead_process` starts it and has the protocol)."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading

import msgpack
import numpy as np

from orchestrator.delivery import shm
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import Served
from orchestrator.delivery.readahead_pipe import (
    CONFIG,
    CREDIT_EVERY,
    ERROR,
    FLUSH,
    FLUSHED,
    HEAD,
    ITEM,
    ITEM_HEAD,
    LINEAGE,
    RECIPE,
    USED,
    WAKE,
    Frames,
)


def _size(item: bytes) -> int:
    """Bytes a queue item holds the trainer's memory to: its segment's, or its own."""
    try:
        ref = shm.reference_of(item)
    except Exception:  # an unknown version: the trainer's accept reports it
        ref = None
    return int(ref["size"]) if ref else len(item)


class Target:
    """The child's target and its accounting: items popped for it and not yet reported
    taken by the trainer (their sizes), against its count (plus the ``CREDIT_EVERY - 1``
    the trainer may have taken and not reported yet) and byte budget; ``cond`` guards
    it."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.count = self.max_bytes = 0
        self.gen = -1
        self.taken = 0
        self.held: collections.deque[int] = collections.deque()  # sizes of the untaken
        self.bytes = 0
        self.stop = self.busy = False
        self.cond = threading.Condition()

    def room(self) -> bool:
        return self.name is not None and (
            not self.held
            or (len(self.held) < self.count + CREDIT_EVERY - 1 and self.bytes < self.max_bytes)
        )

    def used(self, gen: int, taken: int) -> None:
        while gen == self.gen and self.taken < taken and self.held:
            self.bytes -= self.held.popleft()
            self.taken += 1

    def retarget(self, name: str | None, count: int, max_bytes: int, gen: int) -> None:
        if gen != self.gen:  # a new count of the same target keeps what is in flight
            self.taken, self.bytes = 0, 0
            self.held.clear()
        self.name, self.count, self.max_bytes, self.gen = name, count, max_bytes, gen


class FrameWriter:
    """Frames to the trainer on ``out``, each written whole under a lock (the listener and
    the popping loop both write)."""

    def __init__(self, out: int) -> None:
        self.out, self.lock = out, threading.Lock()

    def write(self, kind: int, *payload: bytes | bytearray) -> None:
        """One frame of ``payload``'s parts, joined once (an item is not copied twice)."""
        data = b"".join((HEAD.pack(sum(map(len, payload)), kind), *payload))
        with self.lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self.out, view) :]

    def error(self, e: Exception) -> None:
        """Report ``e`` to the trainer (its next pop raises it), unless the pipe is gone."""
        with contextlib.suppress(OSError):
            self.write(ERROR, f"{type(e).__name__}: {e}".encode())


def write_lineage(client: BatchClient, payload: bytes | bytearray) -> None:
    """Have ``client`` write the lineage entries of a ``LINEAGE`` frame."""
    for recipe, version, policy, ids, at, *more in msgpack.unpackb(payload):
        weights, seed, digest, source = (more + [None] * 4)[:4]
        served = Served(
            int(version),
            np.frombuffer(ids, "<i8"),
            None if weights is None else np.frombuffer(weights, "<f4"),
            seed,
            digest,
            None if source is None else np.frombuffer(source, "<i2"),
        )
        client.trained(recipe, served, policy, at=at)


def drain(lineage: Frames | None, client: BatchClient) -> None:
    """Write the entries waiting in the lineage pipe (read without waiting: the trainer's
    writes to it wake no one)."""
    while lineage is not None and (got := lineage.next(0)) is not None:
        if got[0] == LINEAGE:
            write_lineage(client, got[1])


def listen(
    frames: Frames,
    lineage: Frames | None,
    client: BatchClient,
    target: Target,
    out: FrameWriter,
) -> None:
    """The trainer's frames: credits, lineage, targets, flushes; end of file stops. The
    lineage pipe is read at each credit, flush and at the end (what a killed trainer
    declared is in it)."""
    cond = target.cond
    try:
        while (got := frames.next(None)) is not None:
            kind, payload = got
            if kind == USED:
                drain(lineage, client)
                with cond:
                    target.used(*msgpack.unpackb(payload))
                    cond.notify_all()
            elif kind == LINEAGE:
                write_lineage(client, payload)
            elif kind == RECIPE:
                with cond:
                    target.retarget(*msgpack.unpackb(payload))
                    cond.notify_all()
            elif kind == FLUSH:
                drain(lineage, client)
                with cond:  # a pop under way may still report for the old target
                    while target.busy:
                        cond.wait()
                client.flush_lineage()
                out.write(FLUSHED, payload)
        drain(lineage, client)
    except Exception as e:  # reported to the trainer, then we stop
        out.error(e)
    finally:
        with cond:
            target.stop = True
            cond.notify_all()


def read_ahead(client: BatchClient, target: Target, out: FrameWriter) -> None:
    """Pop the target's items into the pipe while the trainer has room for them, until
    the listener stops."""
    cond = target.cond
    while True:
        with cond:
            while not target.room() and not target.stop:
                cond.wait()
            if target.stop:
                return
            name, gen, target.busy = target.name, target.gen, True
        try:
            item = client.next_item(str(name), timeout=WAKE, explain=False)
            client.count_popped(str(name))  # before a flush: counted for this target
        except TimeoutError:
            item = None  # the trainer's pop explains an empty queue itself
        finally:
            with cond:
                target.busy = False
                cond.notify_all()
        if item is None:
            continue
        with cond:
            if gen == target.gen:
                target.held.append(size := _size(item))
                target.bytes += size
            full = not target.room()
        out.write(ITEM, ITEM_HEAD.pack(gen, full), item)


def main() -> None:
    """The child's life: configured by its first frame, it ends at its input's end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's exit ends us
    out = FrameWriter(os.dup(1))
    os.dup2(2, 1)  # a stray print must not corrupt the frames
    frames = Frames(0)
    got = frames.next(None)
    if got is None or got[0] != CONFIG:
        return
    config = msgpack.unpackb(got[1])
    try:
        client = BatchClient(
            config["namespace"], config["redis_url"], broker_url=config["broker_url"], readahead=0
        )
    except Exception as e:  # the trainer's first pop raises it
        out.write(ERROR, f"{type(e).__name__}: {e}".encode())
        return
    target = Target()
    fd = config.get("lineage_fd")
    lineage = None if fd is None else Frames(fd)
    listener = threading.Thread(
        target=listen,
        args=(frames, lineage, client, target, out),
        name="claw-readahead-listen",
        daemon=True,
    )
    listener.start()
    try:
        read_ahead(client, target, out)
    except BrokenPipeError:
        pass  # the trainer is gone
    except Exception as e:  # the trainer's next pop raises it
        out.error(e)
    finally:
        listener.join(timeout=1.0)
        client.close()  # writes the lineage still held


if __name__ == "__main__":
    main()

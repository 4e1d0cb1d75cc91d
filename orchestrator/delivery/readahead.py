"""``ReadAhead``: decoded batches of one recipe waiting in the trainer's own memory.

A background thread pops from the recipe's Redis queue (:meth:`BatchClient.pop`) into a
local queue bounded by a count and a byte budget, so the trainer's :meth:`pop` is a local
dequeue while batches are ready: bursts of gradient steps (SB3's ``gradient_steps``) no
longer pay a Redis round trip and a decode each. The thread owns its own ``BatchClient``
(its counters are not shared with the trainer's), and errors it meets are raised by the
next :meth:`pop`, never swallowed. ``convert`` turns each batch into what the trainer
wants (e.g. tensors) in the thread too: the trainer's GIL-holding time per batch is then a
dequeue, and the conversion overlaps the trainer's own GIL-free work (torch kernels).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from orchestrator.delivery.lineage import Traced
from orchestrator.sampling import groups
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.groups import Claim


def batch_bytes(batch: Batch) -> int:
    """Bytes held by a batch's arrays (its ids and weights included)."""
    return int(
        sum(a.nbytes for a in (*batch.values(), batch.ids, batch.weights) if hasattr(a, "nbytes"))
    )


class ReadAhead:
    """Keeps up to ``count`` batches (and at most ``max_bytes``; always at least one) of
    recipe ``name`` decoded in this process. ``client`` (a
    :class:`~orchestrator.delivery.client.BatchClient`) gives the thread a client of its
    own (``client.detached()``: same namespace, store and broker, no read-ahead). With
    ``convert``, :meth:`pop` returns ``convert(batch)``, computed in the thread."""

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        count: int = 8,
        max_bytes: int = 64 << 20,
        poll: float = 5.0,
        convert: Callable[[Batch], Any] | None = None,
    ) -> None:
        if count < 1 or max_bytes < 1:
            raise ValueError(
                f"read-ahead needs count >= 1 and max_bytes >= 1, got {count}, {max_bytes}"
            )
        self.name = name
        self.count, self.max_bytes, self.poll = count, max_bytes, poll
        self.convert = convert
        self._client = client.detached()
        self._ready: collections.deque[tuple[Any, int, Claim | None]] = collections.deque()
        self._bytes = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"claw-readahead-{name}", daemon=True
        )
        self._thread.start()

    def _has_room(self) -> bool:
        return not self._ready or (len(self._ready) < self.count and self._bytes < self.max_bytes)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._has_room() and not self._stop.is_set():
                    self._cond.wait()
            if self._stop.is_set():
                return
            try:
                batch = self._client.pop(self.name, timeout=self.poll)
                size = batch_bytes(batch)
                item = batch if self.convert is None else self.convert(batch)
            except TimeoutError:  # (each explained at some cost: ``poll`` is not short)
                continue  # the trainer's pop reports a timeout with the full explanation
            except BaseException as e:  # handed to the trainer's next pop
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready.append((item, size, batch.claim))
                self._bytes += size
                self._cond.notify_all()

    def pop(self, timeout: float | None = 30.0) -> Any:
        """The next batch (converted, with ``convert``): local when one is ready, else waits
        for the thread (TimeoutError after ``timeout`` s, explaining why the recipe's queue
        stays empty)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._ready:
                if self._error is not None:
                    raise self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(self._client.why_empty(self.name, timeout))
                self._cond.wait(left)
            batch, size, _ = self._ready.popleft()
            self._bytes -= size
            self._cond.notify_all()
        return batch

    def trained(self, batch: Traced, policy_version: Any) -> None:
        """Record that ``batch`` (one this read-ahead served, or a part of it) trains
        ``policy_version``: the entry goes out with the thread's next pop, off the
        trainer's path (:meth:`BatchClient.trained`)."""
        self._client.trained(self.name, batch, policy_version)

    def resize(self, count: int) -> None:
        """Keep up to ``count`` batches from now on (batches beyond it are served, not
        dropped)."""
        if count < 1:
            raise ValueError(f"read-ahead needs count >= 1, got {count}")
        with self._cond:
            self.count = count
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._ready)

    def close(self) -> None:
        """Stop the thread and release its connections (batches still held are dropped;
        their rows stay in the store, and the groups ``once`` batches claimed are given
        back)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=self.poll + 5)
        claims = [c for _, _, c in self._ready if c is not None]
        self._ready.clear()
        if claims:
            with contextlib.suppress(Exception):  # the store went away: they stay claimed
                store = self._client.store
                groups.release(store, self.name, claims)
        self._client.close()

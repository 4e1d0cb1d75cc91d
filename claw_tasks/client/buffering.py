"""The buffering half of the Ingestor: the step buffer, the queue of column batches and
the thread that sends them, the timer that flushes by time, and ``flush``/``close``, which
wait for the store's confirmations (collected by :class:`~claw_tasks.client.sending.Sender`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from claw_tasks.client.checks import Step, steps_to_batch
from claw_tasks.client.columns import StepColumns
from claw_tasks.client.sending import FlushResult, IngestError, Sender
from claw_tasks.format.batch import StepBatch

log = logging.getLogger(__name__)

QUEUED_BATCHES = 16
"""Batches of :class:`StepColumns` waiting for the sending thread before an append that
fills one more waits for it (the producer outpacing the broker)."""


class Buffering(Sender):
    """Buffers steps and column batches and sends them from the producer's thread, the
    sending thread and the timer. A base of :class:`~claw_tasks.client.Ingestor`, whose
    ``__init__`` sets these attributes (and starts :meth:`_tick` when ``flush_interval``)."""

    flush_steps: int
    flush_interval: float | None
    _steps: list[Step]
    _first_at: float
    _closed: threading.Event
    _writers: list[StepColumns]
    _queue: deque[StepBatch]
    _queued: threading.Condition
    _sender: threading.Thread | None
    _timer: threading.Thread | None

    def _submit(self, batch: StepBatch) -> None:
        """Queue a writer's batch for the sending thread (started on first use)."""
        with self._queued:
            while len(self._queue) >= QUEUED_BATCHES and not self._closed.is_set():
                self._queued.wait(0.1)
            self._sending += 1  # a flush waits for it until it is sent
            self._queue.append(batch)
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_queued, name="claw-ingest-send", daemon=True
                )
                self._sender.start()
            self._queued.notify_all()

    def _send_queued(self) -> None:
        while True:
            with self._queued:
                while not self._queue:
                    if self._closed.is_set():
                        self._sender = None
                        return
                    self._queued.wait(0.1)
                batch = self._queue.popleft()
                self._queued.notify_all()
            try:
                self._send_or_keep(batch)
            except Exception:  # kept in the unsent list: flush sends it again
                log.warning("sending a batch failed; flush() retries it", exc_info=True)
            finally:
                with self._lock:
                    self._sending -= 1

    # ---- buffering and sending -----------------------------------------------------
    def _buffer(self, step: Step) -> None:
        with self._lock:
            if not self._steps:
                self._first_at = time.monotonic()
            self._steps.append(step)
            if len(self._steps) >= self.flush_steps:
                self._send_buffer()

    def _send_buffer(self) -> None:
        with self._lock:
            steps, self._steps = self._steps, []
            if not steps:
                return
            self._sending += 1  # a concurrent flush waits for this send too
        try:
            assert self.schema is not None
            self._send_or_keep(steps_to_batch(steps, self.schema))
        finally:
            with self._lock:
                self._sending -= 1

    def _tick(self) -> None:
        assert self.flush_interval
        last_poll = time.monotonic()
        while not self._closed.wait(self.flush_interval / 4):
            try:
                with self._lock:
                    due = self._steps and time.monotonic() - self._first_at >= self.flush_interval
                if due:
                    self._send_buffer()
                now = time.monotonic()
                for writer in list(self._writers):
                    if writer.first_at and now - writer.first_at >= self.flush_interval:
                        writer.flush()
                if time.monotonic() - last_poll > max(1.0, self.flush_interval):
                    last_poll = time.monotonic()
                    self._poll()
            except Exception:  # kept for the next tick; this thread must not die
                log.warning("background flush failed; will retry", exc_info=True)

    def flush(self, wait: bool = True, timeout: float = 60.0) -> FlushResult:
        """Send what is buffered; with ``wait``, block until the store confirms every batch
        sent so far and return what was committed (and rejected) since the last flush."""
        self._send_buffer()
        for writer in list(self._writers):
            writer.flush()
        if not wait:
            return FlushResult()
        self._retry_unsent()
        deadline = time.monotonic() + timeout
        delay = 0.002
        # Another thread (the timer, a concurrent flush) may hold steps it took from the
        # buffer and is still publishing: wait for those too, they were "sent so far".
        while ((left := self._poll()) or self._sending) and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 0.01)  # a confirmation is one cheap MGET away
        left = left or self._sending
        with self._lock:
            result, self._confirmed = self._confirmed, FlushResult()
        if left:
            result.pending = left
            raise IngestError(
                f"{left} batch(es) not confirmed within {timeout}s: no ingest worker stored "
                "them. Is the stack running? Start it with `claw up` in another terminal (it "
                "runs the workers). The batches stay in flight and are re-sent; flush again to "
                "keep waiting.",
                result,
            )
        return result

    def close(self, timeout: float = 60.0) -> FlushResult:
        """Flush, wait for confirmation, stop the timer and the sending thread, close the
        connections."""
        self._closed.set()
        if self._timer is not None:
            self._timer.join()
        try:
            return self.flush(wait=True, timeout=timeout)
        finally:
            with self._queued:
                self._queued.notify_all()
            sender = self._sender
            if sender is not None:
                sender.join(timeout)
            if not self._unsent and not self._inflight:
                self.store.r.close()

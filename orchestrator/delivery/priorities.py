"""``PriorityWriter``: priority updates written behind the trainer's call, in order.

A trainer's update would wait ~0.6 ms at 1M steps for the store's script (one round trip
plus a ``SETRANGE`` per id, ``docs/benchmarks.md``, Priorities). Here the call checks and
copies the arrays and returns; a background thread with its own connection takes
everything submitted since its last write, keeps each id's newest priority (later writes
win, as if each call had been written in turn) and writes it with one script call per
shard. Batches already prefetched keep the priorities they were drawn with either way;
:meth:`flush` waits until every submitted update is in the store. Ids evicted or
overwritten meanwhile are skipped, as by ``Store.update_priorities``.

A write that fails (the store unreachable, a script error) loses that write's updates:
the error is counted (:attr:`errors`, :attr:`lost`) and raised by the trainer's next
:meth:`submit`, :meth:`flush` or :meth:`close`, once; the writer keeps writing what is
submitted after it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from claw_tasks.store import Store


def checked(ids: Sequence[int] | np.ndarray, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` as int64 and ``priorities`` as float32 copies, checked as the store checks
    them (raised at the trainer's call, not in the thread)."""
    pr = np.array(priorities, np.float32).reshape(-1)
    ids = np.array(ids, np.int64).reshape(-1)
    if len(pr) != len(ids):
        raise ValueError(f"{len(ids)} ids but {len(pr)} priorities")
    if not np.all(np.isfinite(pr)) or np.any(pr < 0):
        raise ValueError("priorities must be finite and >= 0")
    return ids, pr


def newest(ids: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each id once, with its last priority (the order of later writes winning)."""
    last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]
    return ids[last], priorities[last]


class PriorityWriteError(RuntimeError):
    """Priority updates written behind the trainer's calls failed: ``errors`` writes,
    ``lost`` ids not written (each id of a failed write counted once per write). The
    first failure is the ``__cause__``."""

    def __init__(self, errors: int, lost: int, first: BaseException) -> None:
        super().__init__(
            f"{errors} priority write(s) failed, {lost} id update(s) not written: "
            f"{type(first).__name__}: {first}"
        )
        self.errors, self.lost = errors, lost


class PriorityWriter:
    """Writes submitted priority updates to namespace ``namespace`` in a background thread
    (see the module docstring). ``max_pending`` ids may wait; a submit beyond it blocks
    until the thread has written them (backpressure, not loss)."""

    def __init__(self, namespace: str, redis_url: str, *, max_pending: int = 1 << 20) -> None:
        self.store = Store(redis_url, namespace)
        self.max_pending = max_pending
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._count = 0  # ids pending
        self._submitted = self._written = 0  # calls
        self._updated = 0  # steps updated since the last flush
        self.errors = 0
        """Writes that failed since the writer started (each raised once, see above)."""
        self.lost = 0
        """Id updates those writes did not write."""
        self._failed: tuple[int, int, BaseException] | None = None  # not raised yet
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="claw-priorities", daemon=True)
        self._thread.start()

    def submit(self, ids: Sequence[int] | np.ndarray, priorities: Any) -> None:
        """Queue an update (checked now, written soon; later submits win). Raises
        :class:`PriorityWriteError` first if a write failed since the last raise."""
        ids, pr = checked(ids, priorities)
        with self._cond:
            self._raise()
            while self._count and self._count + len(ids) > self.max_pending:
                self._cond.wait()
                self._raise()
            if self._closed:
                raise RuntimeError("PriorityWriter is closed")
            self._pending.append((ids, pr))
            self._count += len(ids)
            self._submitted += 1
            self._cond.notify_all()

    def _raise(self) -> None:
        if self._failed is not None:
            (errors, lost, first), self._failed = self._failed, None
            raise PriorityWriteError(errors, lost, first) from first

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                taken, self._pending, self._count = self._pending, [], 0
                upto = self._submitted
                self._cond.notify_all()
            if len(taken) == 1:
                ids, pr = newest(*taken[0])
            else:
                ids, pr = newest(
                    np.concatenate([i for i, _ in taken]), np.concatenate([p for _, p in taken])
                )
            try:
                done = self.store.update_priorities(ids, pr)
            except BaseException as e:  # raised by the trainer's next submit, flush, close
                done, error = 0, e
            else:
                error = None
            with self._cond:
                self._written, self._updated = upto, self._updated + done
                if error is not None:
                    self.errors += 1
                    self.lost += len(ids)
                    errors, lost, first = self._failed or (0, 0, error)
                    self._failed = (errors + 1, lost + len(ids), first)
                self._cond.notify_all()

    def wait(self, timeout: float | None = 30.0) -> None:
        """Wait until every update submitted so far is written (TimeoutError after
        ``timeout`` seconds); a failed write stays to be raised by :meth:`submit`,
        :meth:`flush` or :meth:`close`."""
        with self._cond:
            target = self._submitted
            if not self._cond.wait_for(lambda: self._written >= target, timeout):
                raise TimeoutError(f"priority updates not written within {timeout}s")

    def flush(self, timeout: float | None = 30.0) -> int:
        """Wait until every update submitted so far is written; returns how many steps
        were updated since the last flush (evicted ids are not counted). Raises
        :class:`PriorityWriteError` if a write failed since the last raise."""
        with self._cond:
            self.wait(timeout)
            self._raise()
            updated, self._updated = self._updated, 0
            return updated

    def close(self) -> None:
        """Write what is pending, stop the thread, release the connection; then raise
        :class:`PriorityWriteError` if a write failed since the last raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self.store.r.close()
        with self._cond:
            self._raise()

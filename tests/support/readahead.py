"""What the read-ahead tests share: a namespace of one 64-step ramp (obs[:, 0] == reward,
so a batch shows whether its rows are whole) and a bounded wait."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from claw_tasks.client import Ingestor


def ingest_ramp(namespace: str, redis_url: str) -> None:
    """One episode of 64 steps: obs ``[t] * 8`` and reward ``t``."""
    ing = Ingestor(namespace, redis_url, flush_interval=None)
    with ing.episode() as ep:
        for t in range(64):
            ep.add(
                np.full(8, t, np.float32),
                np.int64(0),
                float(t),
                terminated=t == 63,
                next_obs=np.zeros(8, np.float32) if t == 63 else None,
            )
    ing.close()


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)

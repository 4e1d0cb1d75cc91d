"""Near maxmemory the Ingestor blocks or raises before sending, never drops steps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.client.backpressure import StoreFullError
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from tests.support.processes import Worker


def columns(n: int) -> dict:
    return {
        "obs": np.ones((n, 4), np.float32),
        "action": np.zeros(n, np.int64),
        "reward": np.ones(n, np.float32),
        "episode_id": "e",
        "step_index": np.arange(n),
    }


def test_ingestor_raises_or_blocks_near_maxmemory(namespace, tmp_path):
    with RedisServer() as server:
        r = server.client()
        worker = Worker(server.url, "ingest", 1, tmp_path / "worker.log", {})
        try:
            seed = Ingestor(namespace, server.url, flush_interval=None)
            seed.add_batch(columns(100))
            assert seed.close().committed == 100

            def nearly_full() -> None:  # used memory at 80 % of maxmemory (high water 50 %)
                r.set("ballast", b"x" * 2**20)
                r.config_set("maxmemory", int(int(r.info("memory")["used_memory"]) / 0.8))

            nearly_full()
            ing = Ingestor(
                namespace, server.url, flush_interval=None, on_full="raise", memory_high_water=0.5
            )
            with pytest.raises(StoreFullError, match="raise maxmemory"):
                ing.add_batch(columns(100))
                ing.flush()
            # Nothing was lost: the batch is kept and goes out once there is room.
            r.delete("ballast")
            r.config_set("maxmemory", 0)
            assert ing.flush().committed == 100

            blocking = Ingestor(
                namespace, server.url, flush_interval=None, full_timeout=60, memory_high_water=0.5
            )
            nearly_full()
            sent = threading.Event()

            def produce() -> None:
                blocking.add_batch(columns(50))  # a whole batch: sent at once
                blocking.flush()
                sent.set()

            thread = threading.Thread(target=produce)
            thread.start()
            assert not sent.wait(1.0)  # blocked, not failed
            r.delete("ballast")
            r.config_set("maxmemory", 0)
            thread.join(60)
            assert sent.is_set()
            assert Store(server.url, namespace).count() == 250
            ing.close()
            blocking.close()
        finally:
            worker.stop()

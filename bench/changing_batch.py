"""Round trips, draws, time and CPU of a batch while the store changes (a 256-step commit
before each), with a cProfile of those batches if asked.

The store, recipe and filters of ``bench/sample_store.py``. Round trips are counted at
the sockets (a receive after a send), so they include the bulk reader's own connection;
draws are calls of the recipe's sampler. CPU: this process's (``time.process_time``) and
redis-server's (``INFO cpu``) over the batches alone (the commits between them excluded),
which the machine's load skews less than the wall time. With ``--profile N`` a second
pass of as many batches runs under cProfile (its overhead is not in the times). Then the
index is compared with a cold rebuild.

Run: ``.venv/bin/python bench/changing_batch.py [--steps 1000000] [--repeats 300]
[--profile 25]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import time
from typing import Any

import numpy as np
from sample_store import RECIPE, steps

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator import sample
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.samplers import RecipeSampler

_trips = {"n": 0, "sent": False}


def _count_round_trips() -> None:
    """Count a round trip at each receive that follows a send, on every socket."""
    for name in ("sendall", "send"):
        orig = getattr(socket.socket, name)

        def sent(self: socket.socket, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            _trips["sent"] = True
            return _orig(self, *a, **k)

        setattr(socket.socket, name, sent)
    for name in ("recv", "recv_into"):
        orig = getattr(socket.socket, name)

        def received(self: socket.socket, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            _trips["n"] += _trips["sent"]
            _trips["sent"] = False
            return _orig(self, *a, **k)

        setattr(socket.socket, name, received)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--profile", type=int, default=0, help="cProfile lines (0: none)")
    args = parser.parse_args()
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    draws = {"n": 0}
    draw = RecipeSampler.sample

    def counted(self: RecipeSampler, *a: Any, **k: Any) -> Any:
        draws["n"] += 1
        return draw(self, *a, **k)

    RecipeSampler.sample = counted  # type: ignore[method-assign]
    _count_round_trips()
    n, rng = args.steps, np.random.default_rng(0)
    with RedisServer() as server:
        store = Store(server.url, "changing")
        store.create(capacity=n)
        for start in range(0, n, 100_000):
            store.commit(steps(start, min(100_000, n - start), rng))
        index = SamplingIndex(store)
        index.sync()
        for _ in range(5):
            sample(store, RECIPE, rng=rng, index=index)

        def server_cpu() -> float:
            info = store.r.info("cpu")
            return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

        times, trips, cpu, redis_cpu = [], 0, 0.0, 0.0
        draws["n"] = 0
        for i in range(args.repeats):
            store.commit(steps(n + 256 * i, 256, rng))
            s0 = server_cpu()
            _trips["n"] = 0
            c0, t = time.process_time(), time.perf_counter()
            sample(store, RECIPE, rng=rng, index=index)
            times.append(time.perf_counter() - t)
            cpu += time.process_time() - c0
            trips += _trips["n"]
            redis_cpu += server_cpu() - s0  # (includes the INFO call itself)
        drawn = draws["n"]
        prof = cProfile.Profile()
        for i in range(args.repeats if args.profile else 0):
            store.commit(steps(n + 256 * (args.repeats + i), 256, rng))
            prof.enable()
            sample(store, RECIPE, rng=rng, index=index)
            prof.disable()
        cold = SamplingIndex(store)
        cold.sync()
        same = index.columns.keys() == cold.columns.keys() and all(
            np.array_equal(index.columns[c], col, equal_nan=col.dtype.kind == "f")
            for c, col in cold.columns.items()
        )
        print(
            f"{n:,} steps, {args.repeats} batches after a 256-step commit each: "
            f"{trips / args.repeats:.2f} round trips and {drawn / args.repeats:.2f} draws "
            f"a batch; {np.median(times) * 1e3:.2f} ms median "
            f"({np.percentile(times, 95) * 1e3:.2f} p95); CPU a batch "
            f"{cpu / args.repeats * 1e3:.2f} ms here, {redis_cpu / args.repeats * 1e3:.3f} ms "
            f"Redis; index == cold rebuild: {same}"
        )
        if args.profile:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
        store.r.flushdb()


if __name__ == "__main__":
    main()

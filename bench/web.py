"""The web inspector's server time on a large namespace: search and episode pages.

    .venv/bin/python bench/web.py [--steps 1000000] [--episode-len 1000] [--repeat 20]

Starts a private redis-server, fills a namespace through ``Store.commit`` (not timed):
``--steps`` steps in episodes of ``--episode-len``, each with an 8x8 grey frame (drawn as
a thumbnail), a 4-float state, an action, task/agent ids, a numeric tag and an ``info``
dict every 5 steps. Then runs ``claw web`` as a child process, logs in, and times each
page's request over loopback (the figure is the server's time plus well under a
millisecond of loopback): the login and first page (the sampling index built cold), then
``--repeat`` requests of each page (index synced from the change log, nothing new),
reporting p50/p95/max in milliseconds.
"""

from __future__ import annotations

import argparse
import http.cookiejar
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store

ROOT = Path(__file__).resolve().parents[1]
BATCH_EPISODES = 16


def fill(store: Store, steps: int, length: int) -> None:
    rng = np.random.default_rng(0)
    store.create(capacity=steps * 3 // 2, n_shards=4)  # room for shards filling unevenly
    episodes = steps // length
    frame = np.zeros((length, 8, 8), np.uint8)
    frame[:, 2:6, 2:6] = 200
    for first in range(0, episodes, BATCH_EPISODES):
        eps = range(first, min(episodes, first + BATCH_EPISODES))
        n = len(eps) * length
        end = np.zeros(n, bool)
        end[length - 1 :: length] = True
        names = [f"ep{e}" for e in eps]
        info_rows = np.arange(0, n, 5, dtype=np.int32)
        ep_of_row = np.repeat(np.array(eps, np.int32), length)
        store.commit(
            StepBatch(
                episode=StrColumn(names, np.repeat(np.arange(len(eps), dtype=np.int32), length)),
                step_index=np.tile(np.arange(length), len(eps)),
                reward=rng.uniform(-1, 1, n).astype(np.float32),
                terminated=end,
                truncated=np.zeros(n, bool),
                fields={
                    "obs": np.tile(frame, (len(eps), 1, 1)),
                    "state": rng.standard_normal((n, 4)).astype(np.float32),
                    "action": rng.integers(0, 4, n),
                },
                strs={
                    "task_id": StrColumn(["grasp", "reach"], ep_of_row % 2),
                    "agent_id": StrColumn(["a0", "a1", "a2"], ep_of_row % 3),
                },
                nums={"t:level": (ep_of_row % 5).astype(np.float64)},
                info_rows=info_rows,
                info=[{"note": f"row {i}"} for i in info_rows.tolist()],
            )
        )
        print(f"\r  filled {min(episodes, first + BATCH_EPISODES) * length:,} steps", end="")
    print()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--episode-len", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    with RedisServer() as server:
        store = Store(server.url, "bench")
        t0 = time.perf_counter()
        fill(store, args.steps, args.episode_len)
        print(f"fill: {time.perf_counter() - t0:.1f} s, {store.info()['steps']:,} steps")
        port = free_port()
        env = {
            **os.environ,
            "CLAW_REDIS_URL": server.url,
            "CLAW_WEB_PASSWORD": "bench",
            "PYTHONPATH": str(ROOT),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli.main", "web", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            run(f"http://127.0.0.1:{port}", args)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()


def run(base: str, args: argparse.Namespace) -> None:
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            login = urllib.parse.urlencode({"user": "claw", "password": "bench"}).encode()
            t = time.perf_counter()
            opener.open(base + "/login", data=login, timeout=120).read()  # then "/"
            cold = (time.perf_counter() - t) * 1000
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

    def get(path: str) -> float:
        t = time.perf_counter()
        with opener.open(base + path, timeout=120) as r:
            r.read()
            assert r.status == 200, (path, r.status)
        return (time.perf_counter() - t) * 1000

    q = urllib.parse.quote
    mid = args.steps // args.episode_len // 2
    steps_where = q("task_id == 'grasp' and reward > 0.5")
    level_where = q("tags.level >= 3")
    pages = {
        "namespaces page (stats read from Redis, memory sampled)": "/",
        "search, all steps, episodes view": "/ns/bench/search",
        "search, where task_id == 'grasp' and reward > 0.5, steps view": (
            f"/ns/bench/search?view=steps&where={steps_where}"
        ),
        "search, where tags.level >= 3, since 1h, page 5": (
            f"/ns/bench/search?where={level_where}&since=1h&page=5"
        ),
        f"episode view (ep{mid}: {args.episode_len} steps, page of 200)": (
            f"/ns/bench/episode?e=ep{mid}"
        ),
        "thumbnail (cached after the first)": f"/ns/bench/thumb/{mid * 4}/obs.png",
    }
    print(f"login + namespaces page, the sampling index built cold: {cold:.0f} ms")
    print(f"{'page':<70} {'p50':>7} {'p95':>7} {'max':>7}  (ms, {args.repeat} requests)")
    for name, path in pages.items():
        get(path)
        t = np.array([get(path) for _ in range(args.repeat)])
        p50, p95 = np.percentile(t, [50, 95])
        print(f"{name:<70} {p50:7.1f} {p95:7.1f} {t.max():7.1f}")
    load = os.getloadavg()[0]
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load (1 min) {load:.1f}, Python {platform.python_version()}"
    )


if __name__ == "__main__":
    main()

"""Phase 1: Ape-X-style CartPole. Actor processes record, the learner pops and learns.

The learner (this process) registers a recipe: prioritized sampling over all steps mixed
with a source of recent policy versions (``policy_version >= $min_version``, a live param
it moves forward), 3-step returns, a prefetch queue and a sample-to-insert rate limit. It
pops the batches prefetch workers made, takes a double-DQN step, sends the TD errors back
as priorities, and publishes its weights every ``PUBLISH_EVERY`` steps for the actors.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from claw_tasks.connection.client import redis_client
from claw_tasks.format.arrays import unpackb
from claw_tasks.store import Store
from orchestrator.cli.demo import dqn, weights
from orchestrator.cli.demo.actors import episodes_key, epsilon
from orchestrator.cli.devstack import DevStack, Service, log_contains
from orchestrator.delivery.client import BatchClient

RECIPE = "cartpole-dqn"
BATCH = 64
PUBLISH_EVERY = 50  # learner steps between weight versions
ANNEAL_STEPS = 3000  # learner steps over which the actors' epsilon falls to its floor
MIN_VERSION_LAG = 10  # the "fresh" source keeps this many versions
SOLVED_WINDOW = 20


def recipe(min_size: int) -> dict[str, Any]:
    return {
        "name": RECIPE,
        "batch_size": BATCH,
        "fields": ["obs", "action", "reward", "next_obs"],
        "sources": [
            {"name": "replay", "weight": 0.75, "sampler": {"kind": "priority"}},
            {
                "name": "fresh",
                "weight": 0.25,
                "where": {"policy_version": {"ge": "$min_version"}},
                "sampler": {"kind": "priority"},
            },
        ],
        "params": {"min_version": 0},
        "n_step": 3,
        "gamma": 0.99,
        "prefetch": {"depth": 16},
        "rate_limit": {"samples_per_insert": 32.0, "error_buffer": 20_000, "min_size": min_size},
    }


def actor_floor(i: int, n: int) -> float:
    """Ape-X: each actor explores at its own rate, here from 0.1 down to 0.01."""
    return 0.1 ** (1 + (i / (n - 1) if n > 1 else 0))


def actor_service(
    stack: DevStack, namespace: str, i: int, n: int, seed: int, rate: float
) -> Service:
    argv = [
        sys.executable,
        "-m",
        "orchestrator.cli.demo.actors",
        "--redis-url",
        stack.redis_url,
        "--broker-url",
        stack.broker_url,
        "--namespace",
        namespace,
        "--actor",
        str(i),
        "--seed",
        str(seed + i),
        "--anneal-versions",
        str(ANNEAL_STEPS // PUBLISH_EVERY),
        "--floor",
        str(actor_floor(i, n)),
        "--max-rate",
        str(rate),
    ]
    return Service(
        f"actor {i}",
        argv,
        stack.log_dir / f"demo-actor-{i}.log",
        "CartPole-v1",
        log_contains("ready"),
    )


@dataclass
class Episode:
    actor: int
    version: int
    length: int
    ret: float
    at: float  # seconds since the phase started


@dataclass
class ApexResult:
    episodes: list[Episode] = field(default_factory=list)
    learner_steps: int = 0
    env_steps: int = 0
    seconds: float = 0.0
    solved_at: float | None = None  # seconds, when the mean of the last 20 reached the target
    learner_steps_per_s: float = 0.0
    batches_popped: int = 0
    pop_ms: list[float] = field(default_factory=list)
    net: torch.nn.Module | None = None

    def mean_last(self, n: int = SOLVED_WINDOW) -> float:
        rets = [e.ret for e in self.episodes[-n:]]
        return float(np.mean(rets)) if rets else 0.0


class _Monitor:
    """What the live table shows, refreshed a few times a second from Redis."""

    def __init__(self, r: redis.Redis, store: Store, client: BatchClient, total: int) -> None:
        self.r, self.store, self.client = r, store, client
        self.started = time.monotonic()
        self.progress = Progress(
            TextColumn("[bold]CartPole[/] env steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        self.bar = self.progress.add_task("steps", total=total)
        self._seen = 0
        self._rates: deque[tuple[float, int, int]] = deque(maxlen=8)  # (t, committed, steps)
        self.state = "starting"
        self.depth = "-"

    def poll(self, res: ApexResult) -> None:
        raw = self.r.lrange(episodes_key(self.store.namespace), self._seen, -1)
        self._seen += len(raw)
        now = time.monotonic() - self.started
        for item in raw:
            actor, version, length, ret, _ = unpackb(item)
            res.episodes.append(Episode(int(actor), int(version), int(length), float(ret), now))
            res.env_steps += int(length)
        committed = self.store.info()["committed_total"] if self.store.exists() else 0
        self._rates.append((now, committed, res.learner_steps))
        st = self.client.stats(RECIPE)[RECIPE]
        self.depth = f"{st['depth']}/{st['max_depth']}"
        self.state = st["rate_limit"] if st["rate_limited"] else (st["state"] or "starting")
        self.progress.update(self.bar, completed=min(res.env_steps, self.progress.tasks[0].total))

    def rates(self) -> tuple[float, float]:
        if len(self._rates) < 2:
            return 0.0, 0.0
        (t0, c0, s0), (t1, c1, s1) = self._rates[0], self._rates[-1]
        dt = max(t1 - t0, 1e-9)
        return (c1 - c0) / dt, (s1 - s0) / dt

    def view(self, res: ApexResult, version: int, target: float) -> Group:
        ingest, learn = self.rates()
        table = Table(show_header=True, expand=False)
        heads = ("ingest", "queue", "learner", "policy", "episodes", "return")
        for col in heads:
            table.add_column(col, justify="right")
        last = res.episodes[-1].ret if res.episodes else 0.0
        mean = res.mean_last()
        table.add_row(
            f"{ingest:,.0f} steps/s",
            self.depth,
            f"{learn:,.0f} steps/s",
            f"v{version} ε {epsilon(version, ANNEAL_STEPS // PUBLISH_EVERY, 0.1):.2f}",
            f"{len(res.episodes):,}",
            (f"[green]{mean:.0f}[/]" if mean >= target else f"{mean:.0f}")
            + f" mean of {SOLVED_WINDOW} (last {last:.0f})",
        )
        table.caption = f"prefetch: {self.state}"
        return Group(self.progress, table)


def train(
    stack: DevStack,
    namespace: str,
    *,
    steps: int,
    actors: int,
    seed: int,
    target: float,
    console: Console,
) -> ApexResult:
    """Run the actors and learn until the target return or ``steps`` env steps."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    net = dqn.mlp(4, 2)
    learner = dqn.DQN(net, lr=1e-3, target_every=250)
    r = redis_client(stack.redis_url)
    store = Store(r, namespace)
    client = BatchClient(namespace, stack.redis_url, broker_url=stack.broker_url)
    res = ApexResult(net=net)
    version = 0
    weights.publish(r, namespace, version, dqn.to_arrays(net))
    rate = 300.0  # env steps/s per actor: leaves the CPUs to the learner and the workers
    min_size = max(200, min(1000, steps // 10))
    try:
        with console.status(f"starting {actors} actor processes…"):
            stack.start(
                [actor_service(stack, namespace, i, actors, seed, rate) for i in range(actors)]
            )
        # The first batch of steps fixes the namespace schema the recipe is checked against.
        while not store.exists() or store.schema() is None:
            time.sleep(0.05)
        client.register(recipe(min_size))
        mon = _Monitor(r, store, client, steps)
        started = time.monotonic()
        next_poll = 0.0
        with Live(mon.view(res, version, target), console=console, refresh_per_second=4) as live:
            while True:
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + 0.25
                    mon.poll(res)
                    live.update(mon.view(res, version, target))
                    if len(res.episodes) >= SOLVED_WINDOW and res.mean_last() >= target:
                        res.solved_at = now - started
                        break
                    if res.env_steps >= steps:
                        break
                try:
                    t0 = time.perf_counter()
                    batch = client.pop(RECIPE, timeout=0.5)
                    res.pop_ms.append((time.perf_counter() - t0) * 1e3)
                except TimeoutError:
                    continue  # warming up (min_size) or the queue ran dry: keep polling
                td = learner.update(batch, batch.weights)
                client.update_priorities(batch.ids, td + 1e-3)
                res.learner_steps += 1
                if res.learner_steps % PUBLISH_EVERY == 0:
                    version += 1
                    weights.publish(r, namespace, version, dqn.to_arrays(net))
                    if version % MIN_VERSION_LAG == 0:
                        client.set_params(RECIPE, min_version=max(0, version - MIN_VERSION_LAG))
            mon.poll(res)
            live.update(mon.view(res, version, target))
        console.line()
        res.seconds = time.monotonic() - started
        res.learner_steps_per_s = res.learner_steps / max(res.seconds, 1e-9)
        res.batches_popped = res.learner_steps
    finally:
        # SIGTERM: each actor sends what it buffered and waits for the store to confirm it.
        stack.stop_services([s for s in stack.services if s.name.startswith("actor ")], 60)
        client.close()
        r.close()
    return res

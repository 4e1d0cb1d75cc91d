"""`claw demo`: the stack, the phases, the ending; everything it started stops on return.

Redis is the one given (`claw --redis-url` / CLAW_REDIS_URL) or the demo's own embedded
server with its data under the cache dir, never whatever answers on the default port.
Without `keep` the demo's namespaces are removed at the end (and its own server stopped);
with it the stack stays up, with Flower, until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from rich.console import Console

from claw_tasks.connection.client import redis_client
from claw_tasks.connection.server import embedded_dir
from claw_tasks.settings import redact_url
from claw_tasks.store import Store
from orchestrator.cli.devstack import DevStack, flower_service, port_open, worker_service
from orchestrator.inspect.stats import Statistics
from orchestrator.maintenance.lifecycle import drop_namespace

PPO_ROLLOUTS = 10  # the on-policy phase's rollouts (3 in a short run: --steps < 20,000)


@dataclass(frozen=True)
class DemoConfig:
    log_dir: Path
    out: Path
    namespace: str = "demo"
    steps: int = 100_000  # env steps of the CartPole phase at most (it stops once solved)
    actors: int = 2
    images: bool = True
    keep: bool = False
    seed: int = 0
    redis_url: str | None = None
    target: float = 195.0

    @property
    def pixel_namespace(self) -> str:
        return f"{self.namespace}-pixels"

    @property
    def ppo_namespace(self) -> str:
        return f"{self.namespace}-ppo"


def demo_redis_dir() -> Path:
    """The demo's own embedded server keeps its files here, one directory per run (demos
    may run side by side): `~/.cache/claw/demo-redis/<pid>`, removed when it stops."""
    return embedded_dir().parent / "demo-redis" / str(os.getpid())


def _check_deps() -> None:
    missing = [m for m in ("torch", "matplotlib") if not _importable(m)]
    if missing:
        raise RuntimeError(
            f"the demo needs {' and '.join(missing)}: run `make demo`, or "
            "`pip install -e '.[demo]'` in your environment"
        )


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _start(stack: DevStack, cfg: DemoConfig, console: Console) -> None:
    if cfg.redis_url:
        url = stack.start_redis(cfg.redis_url)
        console.print(f"[bold]Redis[/] {redact_url(url)} (given)")
    else:
        directory = demo_redis_dir()
        shutil.rmtree(directory, ignore_errors=True)  # a dead run's with the same pid
        url = stack.start_own_redis(directory)
        console.print(f"[bold]Redis[/] {url} (the demo's own, files in {directory})")
    r = redis_client(url)
    try:
        for ns in (cfg.namespace, cfg.ppo_namespace, cfg.pixel_namespace):
            if Store(r, ns).exists():
                raise RuntimeError(
                    f"namespace {ns!r} already exists at {redact_url(url)} (a `claw demo --keep` "
                    f"left it?): pick another with --namespace, or remove it with `claw drop {ns}`"
                )
    finally:
        r.close()
    with console.status("starting a Celery worker for the ingest and prefetch queues…"):
        stack.start([worker_service(cfg.log_dir, ["ingest", "prefetch"], 2, quick=True)])
    pid = stack.services[-1].pid
    console.print(f"[bold]worker[/] pid {pid} (queues ingest, prefetch; logs {cfg.log_dir})")


def _stored(url: str, namespaces: list[str]):
    from orchestrator.cli.demo.report import Stored

    r = redis_client(url)
    try:
        found = Statistics(r).collect([ns for ns in namespaces if Store(r, ns).exists()])
        return [Stored(s.namespace, s.info["steps"], s.memory_bytes) for s in found.namespaces]
    finally:
        r.close()


def _drop(stack: DevStack, namespaces: list[str]) -> None:
    from orchestrator.delivery.client import BatchClient

    for ns in namespaces:
        client = BatchClient(ns, stack.redis_url, broker_url=stack.broker_url)
        try:
            for name in client.registry.names():
                client.unregister(name)  # its queued batches' shared memory too
            drop_namespace(client.store.r, ns)
        finally:
            client.close()


def run(cfg: DemoConfig, console: Console) -> None:
    _check_deps()
    namespaces = [cfg.namespace, cfg.ppo_namespace]
    namespaces += [cfg.pixel_namespace] if cfg.images else []
    started = time.monotonic()
    try:
        with DevStack(cfg.log_dir) as stack:
            _start(stack, cfg, console)
            try:
                _phases(stack, cfg, console, namespaces, started)
            finally:
                if not cfg.keep:
                    with contextlib.suppress(redis.RedisError, OSError):
                        _drop(stack, namespaces)
            own = " and Redis" if stack.redis_server else ""
            console.print(f"stopping the worker{own}…")
    finally:  # the demo's own server is stopped by now; its files go too
        if not cfg.redis_url:
            shutil.rmtree(demo_redis_dir(), ignore_errors=True)
    console.print("[green]done.[/]")


def _phases(
    stack: DevStack, cfg: DemoConfig, console: Console, namespaces: list[str], started: float
) -> None:
    from orchestrator.cli.demo import apex, offload, ppo, report

    url = stack.redis_url
    console.rule("phase 1: Ape-X DQN on CartPole-v1")
    res = apex.train(
        stack,
        cfg.namespace,
        steps=cfg.steps,
        actors=cfg.actors,
        seed=cfg.seed,
        target=cfg.target,
        console=console,
    )
    console.rule("phase 2: on-policy PPO, rollouts by policy version")
    on = ppo.run(
        stack,
        cfg.ppo_namespace,
        rollouts=PPO_ROLLOUTS if cfg.steps >= 20_000 else 3,
        seed=cfg.seed,
        console=console,
    )
    off = None
    if cfg.images:
        console.rule("phase 3: pixels, augmented by the prefetch workers")
        assert res.net is not None
        off = offload.run(
            stack,
            cfg.pixel_namespace,
            res.net,
            steps=min(3000, max(500, cfg.steps)),
            batches=50 if cfg.steps >= 20_000 else 20,
            seed=cfg.seed,
            console=console,
        )
    console.rule("summary")
    console.print(report.summary(res, on, off, _stored(url, namespaces), cfg.target))
    png = report.learning_curve(res, cfg.out, cfg.target)
    console.print(f"learning curve: [bold]{png}[/]")
    console.print(f"wall time: {time.monotonic() - started:.0f} s")
    flower = _start_flower(stack, cfg) if cfg.keep else None
    report.print_next(console, report.next_steps(url, cfg.namespace, cfg.keep, flower))
    if cfg.keep:
        console.print("[dim]The stack stays up with the data: Ctrl-C stops it.[/]")
        with contextlib.suppress(KeyboardInterrupt):
            stack.watch()


def _start_flower(stack: DevStack, cfg: DemoConfig) -> str:
    port = 5555
    if port_open(port)(None):  # type: ignore[arg-type]  # taken (a `claw up`?): any free one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
    stack.start([flower_service(cfg.log_dir, port)])
    return f"http://127.0.0.1:{port}"

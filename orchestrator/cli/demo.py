"""`claw demo`: an end-to-end run, one function per phase.

Phases: start the stack (Redis, an ingest worker), record CartPole-v1 episodes through
`RecordSteps`, read the store back. Later phases (prefetch, training) slot in after
`record` and reuse the same stack.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from claw_tasks.client import Ingestor
from claw_tasks.gym import RecordSteps
from claw_tasks.settings import redact_url
from claw_tasks.store import Store
from claw_tasks.store.layout import META
from orchestrator.cli.devstack import DevStack, worker_service
from orchestrator.cli.namespaces import memory_by_namespace
from orchestrator.cli.steplog import describe, newest_ids, values


class DemoError(RuntimeError):
    """The demo ran, but its result is wrong (steps lost or rejected)."""


@dataclass(frozen=True)
class DemoConfig:
    log_dir: Path
    namespace: str = "demo"
    steps: int = 5000
    env_id: str = "CartPole-v1"
    seed: int = 0
    redis_url: str | None = None


@dataclass
class Recording:
    steps: int
    episodes: int
    record_s: float  # env stepping and sending
    total_s: float  # until the store confirmed every batch
    committed: int
    rejected: int


@dataclass
class ReadBack:
    steps_stored: int
    memory_bytes: int
    layout_bytes_per_step: int  # metadata columns + fixed payload fields, once chunks fill
    episode_id: str
    episode: dict


def start_stack(stack: DevStack, cfg: DemoConfig, console: Console) -> None:
    """Redis (configured, local, or embedded) and one ingest worker."""
    url = stack.start_redis(cfg.redis_url)
    kind = "embedded, data in " + str(stack.redis_server.dir) if stack.redis_server else "running"
    console.print(f"[bold]Redis[/] {redact_url(url)} ({kind})")
    with console.status("starting an ingest worker…"):
        stack.start([worker_service(cfg.log_dir, ["ingest"], 1, quick=True)])
    console.print(f"[bold]ingest worker[/] pid {stack.services[-1].pid}")


def record(stack: DevStack, cfg: DemoConfig, console: Console) -> Recording:
    """Random-action episodes through `RecordSteps`, until `cfg.steps` and the episode end."""
    ingestor = Ingestor(
        cfg.namespace, stack.redis_url, broker_url=stack.broker_url, flush_steps=1024
    )
    env = RecordSteps(gym.make(cfg.env_id), ingestor, task_id="balance", agent_id="random")
    env.action_space.seed(cfg.seed)
    steps = episodes = 0
    started = time.perf_counter()
    columns = (TextColumn("recording"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(cfg.env_id, total=cfg.steps)
        env.reset(seed=cfg.seed)
        done = False
        while steps < cfg.steps or not done:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            steps += 1
            done = terminated or truncated
            if done:
                episodes += 1
                if steps < cfg.steps:
                    env.reset()
            progress.update(bar, completed=min(steps, cfg.steps))
    record_s = time.perf_counter() - started
    with console.status("waiting for the store to confirm every batch…"):
        result = ingestor.close()
    env.close()
    return Recording(
        steps=steps,
        episodes=episodes,
        record_s=record_s,
        total_s=time.perf_counter() - started,
        committed=result.committed,
        rejected=result.rejected,
    )


def read_back(stack: DevStack, cfg: DemoConfig) -> ReadBack:
    """Memory use, and the newest episode read back with `Store.episode`."""
    client = redis.Redis.from_url(stack.redis_url)
    try:
        store = Store(client, cfg.namespace)
        info = store.info()
        schema = store.schema()
        assert schema is not None  # steps were committed
        newest = newest_ids(store, 1)
        episode_id = store.get(newest, fields=[])["episode_id"][0]
        meta_bytes = sum(dt.itemsize for dt in META.values())
        payload_bytes = sum(s.row_bytes for s in schema.fields.values() if not s.ragged)
        return ReadBack(
            steps_stored=info["steps"],
            memory_bytes=memory_by_namespace(client, cfg.namespace).get(cfg.namespace, 0),
            layout_bytes_per_step=meta_bytes + payload_bytes,
            episode_id=episode_id,
            episode=store.episode(episode_id),
        )
    finally:
        client.close()


def check(rec: Recording) -> None:
    if rec.rejected or rec.committed != rec.steps:
        raise DemoError(
            f"recorded {rec.steps} steps, but {rec.committed} were committed and "
            f"{rec.rejected} rejected (see `claw dead`)"
        )


def report(console: Console, cfg: DemoConfig, rec: Recording, back: ReadBack) -> None:
    table = Table(title=f"claw demo: {cfg.env_id} → namespace {cfg.namespace!r}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("steps committed", f"{rec.committed:,} in {rec.episodes:,} episodes")
    table.add_row("recording (env + client)", f"{rec.steps / rec.record_s:,.0f} steps/s")
    table.add_row("end to end (until committed)", f"{rec.committed / rec.total_s:,.0f} steps/s")
    table.add_row("steps in the namespace", f"{back.steps_stored:,}")
    per_step = back.memory_bytes / back.steps_stored
    mib = back.memory_bytes / 2**20
    table.add_row("Redis memory of the namespace", f"{mib:,.2f} MiB = {per_step:,.0f} B/step")
    table.add_row("… per step once its chunks fill", f"{back.layout_bytes_per_step} B")
    console.print(table)
    console.print(_episode_table(back))


def _episode_table(back: ReadBack, rows: int = 8) -> Table:
    ep = back.episode
    n = len(ep["id"])
    table = Table(title=f"episode {back.episode_id!r} read back ({n} steps)")
    for col in ("id", "step", "reward"):
        table.add_column(col, justify="right")
    for name in ("action", "obs", "next_obs"):
        table.add_column(f"{name} {describe(ep[name][0])}")
    table.add_column("end")
    shown = list(range(min(n, rows)))
    if n > rows:
        shown[-1] = n - 1  # always show the last step and its explicit next_obs
    for i in shown:
        if i == n - 1 and n > rows:
            table.add_row("…")
        end = "terminated" if ep["terminated"][i] else "truncated" if ep["truncated"][i] else ""
        table.add_row(
            str(int(ep["id"][i])),
            str(int(ep["step_index"][i])),
            f"{float(ep['reward'][i]):g}",
            *(values(ep[name][i], "+.3f") for name in ("action", "obs", "next_obs")),
            end,
        )
    return table


def run(cfg: DemoConfig, console: Console) -> None:
    """All phases; everything started here is stopped on return or error."""
    with DevStack(cfg.log_dir) as stack:
        start_stack(stack, cfg, console)
        rec = record(stack, cfg, console)
        check(rec)
        back = read_back(stack, cfg)
        report(console, cfg, rec, back)
        console.print("stopping the worker" + (" and Redis" if stack.redis_server else "") + "…")
    console.print(
        f"[green]done.[/] Look around: [bold]claw stats --namespace {cfg.namespace}[/], "
        f"[bold]claw inspect {cfg.namespace}[/]"
    )

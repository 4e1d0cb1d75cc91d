"""The demo's ending: a summary table, the learning curve as a PNG, what to try next."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from claw_tasks.settings import redact_url
from orchestrator.cli.demo.apex import SOLVED_WINDOW, ApexResult
from orchestrator.cli.demo.offload import CODEC, OffloadResult
from orchestrator.cli.demo.pixels import SIZE
from orchestrator.cli.demo.ppo import EPOCHS, PER_EPOCH, STEPS, PPOResult

FRAME_BYTES = SIZE * SIZE * 3  # one raw RGB frame

PNG_NAME = "claw-demo-learning-curve.png"


@dataclass
class Stored:
    namespace: str
    steps: int
    memory_bytes: int


def summary(
    apex: ApexResult,
    on: PPOResult | None,
    off: OffloadResult | None,
    stored: list[Stored],
    target: float,
) -> Table:
    table = Table(title="claw demo: summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    solved = (
        f"[green]solved[/] in {apex.solved_at:.0f} s"
        if apex.solved_at is not None
        else f"not solved (target {target:g}; raise --steps)"
    )
    table.add_row(
        "CartPole",
        f"mean return of the last {SOLVED_WINDOW} episodes {apex.mean_last():.1f}: {solved}",
    )
    table.add_row(
        "learner",
        f"{apex.learner_steps:,} steps, {apex.learner_steps_per_s:,.0f}/s; "
        f"{len(apex.episodes):,} episodes, {apex.env_steps:,} env steps",
    )
    served = apex.batches_popped + (off.batches if off else 0)
    served += len(on.rollouts) * EPOCHS * PER_EPOCH if on is not None else 0
    table.add_row("batches served", f"{served:,}")
    if apex.pop_ms:
        table.add_row("pop, CartPole batch", f"median {np.median(apex.pop_ms):.2f} ms")
    if on is not None and on.rollouts:
        exact = "[green]each step once per epoch[/]" if on.exact() else "[red]not exact[/]"
        wait = np.median([r.wait_ms for r in on.rollouts])
        table.add_row(
            "PPO rollouts",
            f"{len(on.rollouts)} of {STEPS} steps x {EPOCHS} epochs, its version only: "
            f"{exact}; dropped stale {on.dropped_stale}, lost {on.lost}; learner wait "
            f"median {wait:.0f} ms",
        )
    if off is not None:
        table.add_row(
            "data time per pixel batch",
            f"{off.typical(off.pop_ms):.2f} ms popped (in-loop: "
            f"{off.typical(off.in_loop_ms):.2f} ms); train step "
            f"{off.typical(off.train_ms):.1f} ms; {off.batch_size} x {_px(off)} + random_shift",
        )
    for s in stored:
        per = s.memory_bytes / s.steps if s.steps else 0
        note = ""
        if off is not None and s.namespace == off.namespace and per:
            note = f"; obs stored {CODEC}: {FRAME_BYTES / per:,.1f}x under a raw frame"
        table.add_row(
            f"stored in {s.namespace!r}",
            f"{s.steps:,} steps, {s.memory_bytes / 2**20:,.1f} MiB = {per:,.0f} B/step{note}",
        )
    return table


def _px(off: OffloadResult) -> str:
    return f"{SIZE}x{SIZE}x3 obs"


def learning_curve(apex: ApexResult, out: Path, target: float) -> Path:
    """Episode returns against wall time, their rolling mean and the target, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    path = out / PNG_NAME
    t = np.array([e.at for e in apex.episodes])
    ret = np.array([e.ret for e in apex.episodes])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if len(ret):
        ax.scatter(t, ret, s=6, alpha=0.35, label="episode return (actors, ε-greedy)")
        w = min(SOLVED_WINDOW, len(ret))
        mean = np.convolve(ret, np.ones(w) / w, mode="valid")
        ax.plot(t[w - 1 :], mean, color="C1", label=f"mean of the last {w}")
    ax.axhline(target, color="C2", linestyle="--", label=f"target {target:g}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("return")
    ax.set_title("claw demo: Ape-X DQN on CartPole-v1 through Claw")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def next_steps(url: str, namespace: str, keep: bool, flower: str | None) -> list[str]:
    """Exact commands that reach the demo's store: its URL spelled out, unless it holds a
    password (never printed; then the commands rely on CLAW_REDIS_URL, as this run did)."""
    claw = "claw" if redact_url(url) != url else f"claw --redis-url {shlex.quote(url)}"
    if not keep:
        return [
            "the demo removed its data; to look around afterwards run [bold]claw demo --keep[/]",
            "then, in another terminal, e.g. [bold]claw --redis-url URL stats -n "
            f"{namespace}[/] (the demo prints the exact URL)",
        ]
    lines = [
        f"[bold]{claw} stats -n {namespace}[/]",
        f"[bold]{claw} inspect {namespace} --limit 5[/]",
        f"[bold]{claw} recipes {namespace}[/]",
        f'[bold]{claw} query {namespace} "reward > 0" --group-by agent_id '
        "--agg 'count,mean(policy_version)'[/]",
    ]
    if flower:
        lines.append(f"Flower: {flower}")
    return lines


def print_next(console: Console, lines: list[str]) -> None:
    console.print("[bold]Try next:[/]")
    for line in lines:
        console.print(f"  {line}", soft_wrap=True, highlight=False)

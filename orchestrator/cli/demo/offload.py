"""Phase 2: pixels, augmented by the prefetch workers instead of the training loop.

The learned policy plays CartPole rendered as small RGB images (:mod:`.pixels`), stored
compressed (``obs`` with the ``zstd`` codec: the producer encodes, the prefetch workers
decode before they augment); a recipe
asks for DrQ's ``random_shift`` on ``obs`` and ``next_obs``. A conv Q-network then trains
on the same recipe twice in one run, timing only the trainer's wait for data per batch:
popping what the prefetch workers sampled, shifted and queued, and the in-loop
alternative, sampling and augmenting in the training process
(``orchestrator.sample`` + the recipe's augment pipelines).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.store import Store
from orchestrator.cli.demo import dqn
from orchestrator.cli.demo.pixels import SIZE, Pixels
from orchestrator.cli.devstack import DevStack
from orchestrator.delivery.client import BatchClient
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.sample import sample
from orchestrator.transforms.augment import build_pipelines

RECIPE = "pixels-drq"
CODEC = "zstd"  # the obs field's codec: a rendered frame is mostly background


def recipe(batch_size: int) -> dict[str, Any]:
    return {
        "name": RECIPE,
        "batch_size": batch_size,
        "fields": ["obs", "action", "reward", "next_obs"],
        "sources": [{"name": "all", "sampler": {"kind": "uniform"}}],
        "n_step": 3,
        "gamma": 0.99,
        "augment": {"obs": [{"random_shift": {"pad": 4}}], "next_obs": "same"},
        "prefetch": {"depth": 8},
    }


@dataclass
class OffloadResult:
    namespace: str
    steps: int
    batches: int
    batch_size: int
    pop_ms: list[float]
    in_loop_ms: list[float]
    train_ms: list[float]

    @staticmethod
    def typical(ms: list[float]) -> float:
        return float(np.median(ms)) if ms else float("nan")


def record(
    stack: DevStack,
    namespace: str,
    policy: torch.nn.Module,
    steps: int,
    seed: int,
    console: Console,
) -> int:
    """Episodes of the learned policy (epsilon 0.1) as images, until ``steps``."""
    ingestor = Ingestor(
        namespace,
        stack.redis_url,
        broker_url=stack.broker_url,
        flush_steps=256,
        codecs={"obs": CODEC},
    )
    env = RecordSteps(
        Pixels(gym.make("CartPole-v1")), ingestor, task_id="cartpole-pixels", agent_id="learner"
    )
    rng = np.random.default_rng(seed)
    done, n, episode = True, 0, 0
    columns = (
        TextColumn("[bold]pixels[/] recording"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("record", total=steps)
        while n < steps:
            if done:
                env.reset(seed=seed * 100_000 + episode)
                episode += 1
            state = np.asarray(env.unwrapped.state, np.float32)
            a = int(rng.integers(2)) if rng.random() < 0.1 else dqn.greedy(policy, state)
            _, _, terminated, truncated, _ = env.step(a)
            done = terminated or truncated
            n += 1
            progress.update(bar, completed=n)
    with console.status("waiting for the store to confirm every batch…"):
        result = ingestor.close()
    env.close()
    if result.rejected or result.committed != n:
        raise RuntimeError(
            f"recorded {n} pixel steps, but {result.committed} were committed and "
            f"{result.rejected} rejected (see `claw dead {namespace}`)"
        )
    return n


def measure(
    stack: DevStack,
    namespace: str,
    *,
    batches: int,
    batch_size: int,
    seed: int,
    console: Console,
) -> tuple[list[float], list[float], list[float]]:
    """Data time per batch popped, then in the loop; train time per batch."""
    torch.manual_seed(seed)
    learner = dqn.DQN(dqn.ConvQ((SIZE, SIZE, 3), 2), lr=3e-4, target_every=100)
    spec = Recipe.model_validate(recipe(batch_size))
    client = BatchClient(namespace, stack.redis_url, broker_url=stack.broker_url)
    pop_ms: list[float] = []
    in_loop_ms: list[float] = []
    train_ms: list[float] = []
    columns = (
        TextColumn("[bold]pixels[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    try:
        client.register(spec)
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("training, batches popped", total=batches)
            client.pop(RECIPE, timeout=120)  # the first fill builds the worker's index
            for _ in range(batches):
                t0 = time.perf_counter()
                batch = client.pop(RECIPE, timeout=120)
                pop_ms.append((time.perf_counter() - t0) * 1e3)
                t1 = time.perf_counter()
                learner.update(batch, batch.weights)
                train_ms.append((time.perf_counter() - t1) * 1e3)
                progress.advance(bar)
            client.unregister(RECIPE)  # its workers stop; the loop below has the CPU
            plan = build_pipelines(spec.augment)
            rng = np.random.default_rng(seed)
            store = Store(stack.redis_url, namespace)
            sample(store, spec, rng=rng)  # the same warm-up: the index is built once
            bar = progress.add_task("training, sampled + augmented in the loop", total=batches)
            for _ in range(batches):
                t0 = time.perf_counter()
                drawn = sample(store, spec, rng=rng)
                fields = plan.apply(drawn.fields, rng)
                in_loop_ms.append((time.perf_counter() - t0) * 1e3)
                learner.update(fields, drawn.weights)
                progress.advance(bar)
            store.r.close()
    finally:
        client.close()
    return pop_ms, in_loop_ms, train_ms


def run(
    stack: DevStack,
    namespace: str,
    policy: torch.nn.Module,
    *,
    steps: int,
    batches: int,
    seed: int,
    console: Console,
) -> OffloadResult:
    batch_size = 64
    n = record(stack, namespace, policy, steps, seed, console)
    pop_ms, in_loop_ms, train_ms = measure(
        stack, namespace, batches=batches, batch_size=batch_size, seed=seed, console=console
    )
    return OffloadResult(namespace, n, batches, batch_size, pop_ms, in_loop_ms, train_ms)

"""How the rollout a :class:`~orchestrator.adapters.sb3.rollout.ClawRolloutBuffer` pops
once becomes every epoch SB3 asks for: epoch e is the same rows in the order the rollout
mode serves epoch e (``rollouts.permutation`` of the seed and rollout number the message
carries), cut into SB3's minibatches."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch as th

from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.rollout_state import permutation
from orchestrator.sampling.batch import Batch

log = logging.getLogger(__name__)


def pop_rollout(
    client: BatchClient, recipe: str, timeout: float | None, version: int, steps: int
) -> tuple[Batch, dict[str, Any]]:
    """The next popped batch that is rollout ``version`` of ``steps`` steps, and its
    ``rollout`` meta; a minibatch of another rollout is dropped."""
    while True:
        batch = client.pop(recipe, timeout)
        ro = batch.meta.get("rollout", {})
        if ro.get("policy_version") == version and ro.get("steps") == steps:
            return batch, ro
        log.debug("ClawRolloutBuffer: dropped a minibatch of another rollout: %s", ro)


def first_positions(seed: int, no: int, steps: int) -> np.ndarray:
    """Where each chain position sits in the served (first) epoch."""
    first = np.empty(steps, np.int64)  # served row i holds chain position perm0[i]
    first[permutation(seed, no, 0, steps)] = np.arange(steps)
    return first


def minibatches(
    samples: Callable[..., Any],
    data: tuple[Any, ...],
    first: np.ndarray,
    seed: int,
    no: int,
    epoch: int,
    batch_size: int | None,
    device: th.device | str,
) -> Generator[Any, None, None]:
    """Epoch ``epoch`` of ``data`` (the first epoch's tensors) as ``samples`` tuples of
    ``batch_size`` rows (None: one of them all)."""
    steps = len(first)
    if epoch:  # served position of each chain position, then epoch e in that order
        order = th.as_tensor(first[permutation(seed, no, epoch, steps)], device=device)
        data = tuple(take(x, order) for x in data)
    size = steps if batch_size is None else batch_size
    for start in range(0, steps, size):
        yield samples(*(take(x, slice(start, start + size)) for x in data))


def take(x: Any, rows: Any) -> Any:
    """Rows of a tensor, or of each tensor of a Dict observation."""
    return {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]

"""``ClawIterableDataset``: a PyTorch ``IterableDataset`` of prefetched Claw batches.

Each item is one whole batch, a dict of tensors (the recipe's fields plus ``ids`` and
``weights``), so use it with ``DataLoader(dataset, batch_size=None)``. Batching,
augmentation and collation already happened in the prefetch workers; the trainer only pops.

Lineage: each batch is recorded as training a policy version (``claw lineage NS --policy
v``), by default ``"updates"``: its place in the ``DataLoader``'s order, 1, 2, ... (one
optimizer step a batch: the policy after ``v`` steps). With ``num_workers=W`` the loader
takes batches from the workers in turn, so worker ``w``'s ``k``-th batch is number
``k * W + w + 1``; that holds while every worker yields as many (``num_batches``, or
endless). A callable gets that number and returns the version (e.g. ``lambda i: i //
accumulation`` for gradient accumulation; it runs in the worker processes, so it must
pickle); None records nothing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from orchestrator.adapters.options import refuse_renamed
from orchestrator.adapters.versions import PolicyVersion, Versions
from orchestrator.delivery.client import BatchClient
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.batch import Batch

__all__ = ["ClawIterableDataset", "batch_to_tensors", "to_tensor"]

Item = dict[str, Any]


def to_tensor(arr: np.ndarray, pin_memory: bool = False) -> torch.Tensor:
    """A tensor of ``arr``: zero-copy when it is writable, else exactly one copy (straight
    into pinned memory when ``pin_memory``)."""
    if pin_memory:
        dtype = torch.from_numpy(np.empty(0, arr.dtype)).dtype
        out = torch.empty(arr.shape, dtype=dtype, pin_memory=True)
        np.copyto(out.numpy(), arr)
        return out
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def batch_to_tensors(
    batch: Batch, pin_memory: bool = False, device: torch.device | None = None
) -> Item:
    """A batch as a dict of tensors; what is not a numeric array (the batch's ``meta``:
    strings, ``info`` dicts) is passed through unchanged."""
    out: Item = {**batch.meta}
    arrays = {**batch, "ids": batch.ids, "weights": batch.weights}
    for name, value in arrays.items():
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
            out[name] = value
            continue
        t = to_tensor(value, pin_memory)
        out[name] = t if device is None else t.to(device, non_blocking=pin_memory)
    return out


class ClawIterableDataset(IterableDataset):
    """Endless (or ``num_batches`` long) stream of one recipe's batches as tensors.

    ``recipe`` is a registered recipe's name, or a recipe (model or mapping) that is
    registered here. Each iterator (each ``DataLoader`` worker) pops with its own
    :class:`~orchestrator.delivery.client.BatchClient`; workers share the recipe's queue.
    ``pin_memory`` is ignored, with a warning, when no accelerator is available.
    ``policy_version``: what each batch is recorded as training (the module docstring).
    """

    @refuse_renamed
    def __init__(
        self,
        recipe: str | Recipe | Mapping[str, Any],
        namespace: str | None = None,
        redis_url: str | None = None,
        *,
        broker_url: str | None = None,
        timeout: float | None = 30.0,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
        num_batches: int | None = None,
        policy_version: PolicyVersion = "updates",
    ) -> None:
        super().__init__()
        Versions(policy_version, {"updates": int})  # checked here, not in the workers
        self.policy_version = policy_version
        self.namespace, self.redis_url, self.broker_url = namespace, redis_url, broker_url
        if isinstance(recipe, str):
            self.name = recipe
        else:
            client = self._client()
            try:
                self.name = client.register(recipe).name
            finally:
                client.close()
        if pin_memory and not torch.accelerator.is_available():
            warnings.warn("pin_memory: no accelerator available; not pinning", stacklevel=2)
            pin_memory = False
        self.pin_memory = pin_memory
        self.device = None if device is None else torch.device(device)
        self.timeout = timeout
        self.num_batches = num_batches
        self._own: tuple[int, BatchClient] | None = None  # this process's client, for priorities

    def _client(self) -> BatchClient:
        return BatchClient(self.namespace, self.redis_url, broker_url=self.broker_url)

    def __iter__(self) -> Iterator[Item]:
        client = self._client()
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        number = 0
        versions = Versions(self.policy_version, {"updates": lambda: number})
        try:
            n = 0
            while self.num_batches is None or n < self.num_batches:
                number = n * workers + worker + 1  # in the loader's order (module docstring)
                version = versions.of(number)
                batch = client.pop(self.name, timeout=self.timeout, policy_version=version)
                yield batch_to_tensors(batch, self.pin_memory, self.device)
                n += 1
        finally:
            client.close()

    def update_priorities(self, ids: Any, priorities: Any, *, wait: bool = False) -> int | None:
        """Send new priorities (tensors or arrays) for the steps ``ids``: written behind,
        in order, by this process's client (``BatchClient.update_priorities``; written by
        :meth:`close` at the latest). ``wait=True`` writes them now and returns how many
        steps were updated."""
        if self._own is None or self._own[0] != os.getpid():
            self._own = (os.getpid(), self._client())
        return self._own[1].update_priorities(_numpy(ids), _numpy(priorities), wait=wait)

    def flush_priorities(self, timeout: float | None = 30.0) -> int:
        """Wait until this process's priority updates are written (steps updated)."""
        if self._own is None or self._own[0] != os.getpid():
            return 0
        return self._own[1].flush_priorities(timeout)

    def close(self) -> None:
        """Write this process's pending priority updates and close its client (iterators
        close their own)."""
        if self._own is not None and self._own[0] == os.getpid():
            self._own[1].close()
        self._own = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_own": None}  # DataLoader workers make their own clients


def _numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)

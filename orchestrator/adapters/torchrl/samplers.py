"""TorchRL samplers of a :class:`~orchestrator.adapters.torchrl.storage.ClawStorage`: the
draw itself happens in Claw's prefetch workers; these name the Claw sampler to use and
send priorities back.

``ClawPrioritizedSampler`` subclasses TorchRL's ``PrioritizedSampler`` (so
``TensorDictReplayBuffer.update_tensordict_priority`` and TorchRL's trainers treat it as
prioritized) without building its sum trees: those need TorchRL's C++ extension for the
exact torch version, and Claw keeps the priorities in Redis instead.
"""

from __future__ import annotations

import json
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, Sampler
from torchrl.data.replay_buffers.storages import Storage

from orchestrator.adapters.torchrl.storage import ClawStorage, numpy_of


def _claw(storage: Storage | None) -> ClawStorage:
    if not isinstance(storage, ClawStorage):
        raise TypeError(
            f"Claw samplers draw from a ClawStorage, got {type(storage).__name__}: "
            "build the buffer with storage=ClawStorage(...)"
        )
    return storage


class ClawSampler(Sampler):
    """Uniform draws (with replacement) over the storage's namespace."""

    def source(self) -> dict[str, Any]:
        """The recipe source's sampler this sampler stands for."""
        return {"kind": "uniform"}

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        ids, _ = _claw(storage).draw(self.source(), batch_size)
        return ids, {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return

    def _empty(self) -> None:
        return

    def dumps(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "claw_sampler.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path: str | Path) -> None:
        self.load_state_dict(json.loads((Path(path) / "claw_sampler.json").read_text()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ClawPrioritizedSampler(PrioritizedSampler):
    """Prioritized draws, P(i) = p_i^alpha / sum_j p_j^alpha, with importance weights
    (``priority_weight``) for ``beta``; a step with no priority yet counts at the running
    maximum. ``update_priority`` sends ``|priority| + eps`` of the sampled steps to Claw
    written behind the trainer's call (``BatchClient.update_priorities``: later updates win;
    ``storage.flush()`` waits for them); batches already prefetched keep the priorities
    they were drawn with. ``memory`` batches of step ids are remembered to tell sampled
    indices from others (extend's slot positions, an initial fill), which are skipped.
    ``reduction`` reduces a row's multi-element priority (TorchRL's: max, min, mean, median)."""

    def __init__(
        self,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-8,
        *,
        reduction: str = "max",
        memory: int = 64,
    ) -> None:
        # Not PrioritizedSampler.__init__: it builds TorchRL's sum trees.
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.reduction = reduction
        self._recent: deque[np.ndarray] = deque(maxlen=memory)
        self._extended: torch.Tensor | None = None
        self._storage: ClawStorage | None = None
        self._warned = False

    def source(self) -> dict[str, Any]:
        return {"kind": "priority", "alpha": self._alpha, "beta": self._beta}

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        raise AttributeError(
            "a Claw recipe's alpha is fixed when it is registered: build a "
            "new ClawPrioritizedSampler to change it"
        )

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        raise AttributeError(
            "a Claw recipe's beta is fixed when it is registered: build a "
            "new ClawPrioritizedSampler to change it"
        )

    @property
    def max_size(self) -> int:
        return 0 if self._storage is None else self._storage.max_size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def default_priority(self) -> float:
        return 1.0

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        self._storage = _claw(storage)
        ids, weights = self._storage.draw(self.source(), batch_size)
        self._recent.append(ids.numpy())
        return ids, {"priority_weight": weights}

    def add(self, index: Any) -> None:
        self._extended = torch.as_tensor(index)

    def extend(self, index: Any) -> None:
        self._extended = index  # its update_priority (TensorDictReplayBuffer.extend) is skipped

    def update_priority(
        self, index: Any, priority: Any, *, storage: Storage | None = None
    ) -> dict | None:
        """Send ``|priority| + eps`` for the sampled steps ``index`` to Claw."""
        if index is self._extended or not self._recent:
            return None  # slot positions or an initial fill: priorities came with the rows
        ids = numpy_of(index).astype(np.int64).reshape(-1)
        pr = np.abs(numpy_of(priority).astype(np.float32)).reshape(-1)
        if pr.size == 1 and ids.size > 1:
            pr = np.repeat(pr, ids.size)
        if pr.size != ids.size:
            raise ValueError(f"{ids.size} indices but {pr.size} priorities")
        known = self._sampled(ids)
        if not known.all():
            ids, pr = ids[known], pr[known]
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "ClawPrioritizedSampler.update_priority: indices this sampler "
                    "did not return (or returned more than `memory` batches ago) "
                    "are skipped: Claw's indices are step ids",
                    stacklevel=2,
                )
        target = storage if isinstance(storage, ClawStorage) else self._storage
        if len(ids) and target is not None:
            target.update_priorities(ids, pr + self._eps)
        return None

    def _sampled(self, ids: np.ndarray) -> np.ndarray:
        for recent in reversed(self._recent):  # the usual case: the batch just drawn
            if recent.shape == ids.shape and np.array_equal(recent, ids):
                return np.ones(len(ids), bool)
        return np.isin(ids, np.concatenate(list(self._recent)))

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        return

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self._alpha, "beta": self._beta, "eps": self._eps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._alpha, self._beta = float(state_dict["alpha"]), float(state_dict["beta"])
        self._eps = float(state_dict["eps"])

    def _empty(self) -> None:
        self._recent.clear()
        self._extended = None

    def dumps(self, path: str | Path) -> None:
        ClawSampler.dumps(self, path)  # type: ignore[arg-type]  # the same JSON state methods on another sampler class

    def loads(self, path: str | Path) -> None:
        ClawSampler.loads(self, path)  # type: ignore[arg-type]  # the same JSON state methods on another sampler class

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_storage": None, "_extended": None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps})"

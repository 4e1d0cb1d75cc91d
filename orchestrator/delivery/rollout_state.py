"""A ``rollout`` recipe's formed rollout (:class:`Plan`, its minibatches' permutations)
and its state hash ``ro:<name>`` (:class:`State`), as :mod:`orchestrator.delivery.rollouts`
lays them out."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.format.arrays import pack_array, packb, unpack_array, unpackb
from orchestrator.delivery.registry import Registry


class EpochOrders:
    """The epochs' orders of rollout ``no`` (of ``n`` steps, seeded ``seed``: the plan's
    and every minibatch's ``meta["rollout"]``), as positions in the rollout's chain order:
    epoch e is the (e + 1)-th ``permutation(n)`` of ``default_rng([seed, no])``, and
    minibatch j of it is its j-th slice. One generator per rollout, its epochs drawn in
    turn as they are first asked for (~5 us each for 256 steps; a generator made per
    epoch cost ~50 us, 20 a rollout in PPO's ``n_epochs``): an epoch's order does not
    depend on how many follow it, so a fill that cuts epoch 3 and a trainer that reorders
    20 agree.

    Held: the generator and the last :data:`KEEP` orders asked for (a trainer's first
    epoch and its current one; a fill crossing an epoch's end), so memory does not grow
    with ``epochs`` x ``n``. An older epoch asked again (rare: fills and trainers go
    forward) is drawn again by a fresh generator. Thread-safe."""

    KEEP = 2

    def __init__(self, seed: int, no: int, n: int) -> None:
        self._seed = [seed, no]
        self._rng = np.random.default_rng(self._seed)
        self._n = n
        self._next = 0  # the epoch the generator draws next
        self._kept: dict[int, np.ndarray] = {}  # the last KEEP asked for, oldest first
        self._lock = threading.Lock()

    def __getitem__(self, epoch: int) -> np.ndarray:
        if epoch < 0:
            raise IndexError(f"epoch {epoch}")
        with self._lock:
            perm = self._kept.pop(epoch, None)
            if perm is None:
                if epoch < self._next:  # drawn and dropped: a generator from the start
                    self._rng, self._next = np.random.default_rng(self._seed), 0
                while self._next <= epoch:
                    perm, self._next = self._rng.permutation(self._n), self._next + 1
                assert perm is not None
                perm.flags.writeable = False
            self._kept[epoch] = perm
            while len(self._kept) > self.KEEP:
                del self._kept[next(iter(self._kept))]
            return perm


@functools.lru_cache(maxsize=4)
def epoch_orders(seed: int, no: int, n: int) -> EpochOrders:
    """Rollout ``no``'s :class:`EpochOrders` (cached while fills cut its epochs)."""
    return EpochOrders(seed, no, n)


def permutation(seed: int, no: int, epoch: int, n: int) -> np.ndarray:
    """Epoch ``epoch`` of rollout ``no`` of ``n`` steps seeded ``seed``
    (:class:`EpochOrders`); minibatch j of that epoch is its j-th slice."""
    return epoch_orders(seed, no, n)[epoch]


@dataclass(frozen=True)
class Plan:
    """A formed rollout: its steps in chain order and what each minibatch adds to them."""

    no: int
    target: int
    seed: int
    epochs: int
    batch_size: int
    ids: np.ndarray  # int64
    advantages: np.ndarray  # float32
    returns: np.ndarray  # float32
    log_prob: np.ndarray  # float32: the behaviour policy's
    value: np.ndarray  # float32: the behaviour critic's
    version: np.ndarray  # int32: each step's policy_version

    @property
    def per_epoch(self) -> int:
        return len(self.ids) // self.batch_size

    @property
    def total(self) -> int:
        return self.epochs * self.per_epoch

    def minibatch(self, k: int) -> np.ndarray:
        """Positions of minibatch ``k``: a slice of its epoch's permutation."""
        epoch, j = divmod(k, self.per_epoch)
        perm = permutation(self.seed, self.no, epoch, len(self.ids))
        return perm[j * self.batch_size : (j + 1) * self.batch_size]

    _ARRAYS = ("ids", "advantages", "returns", "log_prob", "value", "version")

    def to_bytes(self) -> bytes:
        head = {k: getattr(self, k) for k in ("no", "target", "seed", "epochs", "batch_size")}
        return packb({**head, **{k: pack_array(getattr(self, k)) for k in self._ARRAYS}})

    @classmethod
    def from_bytes(cls, raw: bytes) -> Plan:
        d = unpackb(raw)
        return cls(**{k: unpack_array(v) if k in cls._ARRAYS else int(v) for k, v in d.items()})


@dataclass(frozen=True)
class State:
    """``ro:<name>``, decoded (see the module docstring)."""

    no: int
    target: int | None
    rv: int
    cursor: int
    total: int
    dropped_stale: int
    lost: int
    waiting_since: float | None

    @classmethod
    def of(cls, raw: dict[bytes, bytes]) -> State:
        def num(k: str, default: float | None = 0) -> Any:
            v = raw.get(k.encode())
            return default if v is None else float(v)

        target = num("target", None)
        return cls(
            int(num("no")),
            None if target is None else int(target),
            int(num("rv")),
            int(num("cursor")),
            int(num("total")),
            int(num("dropped_stale")),
            int(num("lost")),
            num("waiting_since", None),
        )

    def describe(self) -> dict[str, Any]:
        """What ``BatchClient.stats`` and ``claw recipes`` show."""
        return {
            "rollouts": self.no,
            "policy_version": self.target,
            "minibatches_pushed": self.cursor,
            "minibatches": self.total,
            "dropped_stale": self.dropped_stale,
            "lost": self.lost,
        }


def read_state(reg: Registry, name: str) -> State:
    return State.of(reg.r.hgetall(reg.rollout_keys(name)[0]))

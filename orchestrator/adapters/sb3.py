"""``ClawReplayBuffer``: a Stable-Baselines3 ``ReplayBuffer`` whose data lives in Claw.

Use it as ``replay_buffer_class=ClawReplayBuffer`` of DQN, SAC or TD3, with Claw options in
``replay_buffer_kwargs`` (``namespace``, ``redis_url``, ``recipe`` overrides, ...).

``add`` ingests transitions through an :class:`~claw_tasks.client.Ingestor` (one episode
per env index, a new one after each ``done``). A transition is written when the env's next
one arrives: if its ``next_obs`` is that transition's ``obs`` (always, in SB3's own loop) it
is stored once, as Claw does; otherwise, and at episode ends, it is stored explicitly.
``sample`` pops a prefetched batch of a recipe registered on first use (uniform over the
namespace unless overridden) and returns SB3's ``ReplayBufferSamples``: ``dones`` are the
terminations (timeouts bootstrap, as SB3's ``dones * (1 - timeouts)``), ``rewards`` have
shape (B, 1), observations and rewards go through ``VecNormalize`` when given. An n-step
recipe (``n_step > 1``) yields the n-step return, its ``done`` and ``discounts``.

The parent's numpy arrays are never allocated; ``pos``, ``full`` and ``size()`` count the
transitions this buffer added, capped at ``buffer_size`` like SB3's ring. Batches are
drawn from what the store has committed, which trails ``add`` by the ingest flush
interval plus the prefetch queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from claw_tasks.client import Episode, Ingestor
from claw_tasks.schema import FieldSpec, Schema
from claw_tasks.settings import load_settings
from claw_tasks.store import Store
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.wire import Batch

FIELDS = ["obs", "action", "reward", "next_obs", "terminated", "truncated"]


@dataclass
class _Pending:
    """An env's newest transition, held until its successor shows how to store next_obs."""

    episode: Episode
    obs: np.ndarray
    action: np.ndarray
    reward: float
    next_obs: np.ndarray

    def write(self, explicit_next: bool) -> None:
        nxt = self.next_obs if explicit_next else None
        self.episode.add(self.obs, self.action, self.reward, next_obs=nxt)


class ClawReplayBuffer(ReplayBuffer):
    """SB3 replay buffer backed by a Claw namespace (see the module docstring).

    ``recipe`` overrides keys of the default recipe (name ``sb3``, the fields above, one
    uniform source); ``batch_size`` always comes from ``sample``. ``capacity`` defaults to
    ``buffer_size`` when the namespace is new. ``episode`` holds keyword arguments of
    :meth:`Ingestor.episode` (``task_id``, ``agent_id``, tags); ``ingest`` those of the
    :class:`Ingestor` (``flush_steps``, ``flush_interval``, ...). ``timeout`` bounds a pop.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        namespace: str | None = None,
        redis_url: str | None = None,
        broker_url: str | None = None,
        recipe: Mapping[str, Any] | None = None,
        capacity: int | None = None,
        episode: Mapping[str, Any] | None = None,
        ingest: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
    ) -> None:
        if optimize_memory_usage:
            raise ValueError("optimize_memory_usage: not needed, Claw stores next_obs once")
        if isinstance(observation_space, spaces.Dict):
            raise TypeError("ClawReplayBuffer takes Box/Discrete/... observations, not Dict")
        # Not ReplayBuffer.__init__: it allocates the arrays Claw replaces.
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = handle_timeout_termination
        self.obs_dtype = np.dtype(observation_space.dtype)
        self.action_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))
        settings = load_settings()
        namespace = namespace or settings.namespace
        if capacity is None and not Store(redis_url or settings.redis_url, namespace).exists():
            capacity = buffer_size
        schema = Schema(
            fields={
                "obs": FieldSpec(self.obs_dtype.str, tuple(self.obs_shape)),
                "action": FieldSpec(self.action_dtype.str, (self.action_dim,)),
            }
        )
        ingest_kw = {"flush_steps": 256, "flush_interval": 0.25, **(ingest or {})}
        self.ingestor = Ingestor(
            namespace, redis_url, broker_url=broker_url, capacity=capacity, schema=schema,
            **ingest_kw,
        )  # fmt: skip
        self.client = BatchClient(namespace, redis_url, broker_url=broker_url)
        self.recipe = {
            "name": "sb3",
            "fields": FIELDS,
            "sources": [{"name": "all", "sampler": {"kind": "uniform"}}],
            **(recipe or {}),
        }
        self.timeout = timeout
        self._episode_kw = dict(episode or {})
        self._episodes = [self.ingestor.episode(**self._episode_kw) for _ in range(n_envs)]
        self._pending: list[_Pending | None] = [None] * n_envs
        self._names: dict[int, str] = {}  # batch size -> registered recipe name

    # ---- writing -------------------------------------------------------------------
    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        """Ingest one transition per env (SB3's shapes: obs (n_envs, *obs_shape), ...)."""
        shape = (self.n_envs, *self.obs_shape)
        obs = np.array(obs, dtype=self.obs_dtype).reshape(shape)
        next_obs = np.array(next_obs, dtype=self.obs_dtype).reshape(shape)
        action = np.array(action, dtype=self.action_dtype).reshape(self.n_envs, self.action_dim)
        reward = np.asarray(reward, dtype=np.float32).reshape(self.n_envs)
        done = np.asarray(done).reshape(self.n_envs)
        for i in range(self.n_envs):
            held = self._pending[i]
            if held is not None:
                held.write(explicit_next=not np.array_equal(held.next_obs, obs[i]))
            episode = self._episodes[i]
            if not done[i]:
                self._pending[i] = _Pending(
                    episode, obs[i], action[i], float(reward[i]), next_obs[i]
                )
                continue
            self._pending[i] = None
            timeout = bool(infos[i].get("TimeLimit.truncated", False))
            episode.add(
                obs[i], action[i], float(reward[i]), next_obs=next_obs[i],
                terminated=not timeout, truncated=timeout,
            )  # fmt: skip
            self._episodes[i] = self.ingestor.episode(**self._episode_kw)
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full, self.pos = True, 0

    def flush(self, timeout: float = 60.0) -> None:
        """Write every transition added so far (each env's newest with its next_obs) and
        wait until the store has committed them."""
        for i, held in enumerate(self._pending):
            if held is not None:
                held.write(explicit_next=True)
                self._pending[i] = None
        self.ingestor.flush(wait=True, timeout=timeout)

    # ---- sampling ------------------------------------------------------------------
    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """A prefetched batch of ``batch_size`` transitions, as SB3 samples them."""
        batch = self.client.pop(self.recipe_name(batch_size), timeout=self.timeout)
        return self.to_samples(batch, env)

    def recipe_name(self, batch_size: int) -> str:
        """The recipe serving ``batch_size``, registered on first use (after a flush, so
        everything added so far can be drawn)."""
        name = self._names.get(batch_size)
        if name is None:
            self.flush()
            base = str(self.recipe["name"])
            name = f"{base}-{batch_size}" if self._names else base
            spec = {**self.recipe, "name": name, "batch_size": batch_size}
            self._names[batch_size] = self.client.register(spec).name
        return name

    def to_samples(self, batch: Batch, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """SB3's view of a Claw batch."""
        if "done" in batch:  # n-step: termination within the m steps, discount gamma^m
            dones = batch["done"]
            discounts = self.to_torch(batch["discount"].reshape(-1, 1))
        else:
            dones = batch["terminated"]
            if not self.handle_timeout_termination:
                dones = dones | batch["truncated"]
            discounts = None
        data = (
            self._normalize_obs(batch["obs"], env),
            batch["action"],
            self._normalize_obs(batch["next_obs"], env),
            dones.astype(np.float32).reshape(-1, 1),
            self._normalize_reward(batch["reward"].reshape(-1, 1), env),
        )
        return ReplayBufferSamples(*map(self.to_torch, data), discounts=discounts)

    def close(self) -> None:
        """Flush, unregister this buffer's recipes, release connections."""
        self.flush()
        self.ingestor.close()
        for name in self._names.values():
            self.client.unregister(name)
        self._names.clear()
        self.client.close()

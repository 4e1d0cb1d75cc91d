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

Where it differs from SB3's buffer, and why:

- The parent's numpy arrays are never allocated; ``pos``, ``full`` and ``size()`` count the
  transitions this buffer added, capped at ``buffer_size`` like SB3's ring.
  ``optimize_memory_usage`` is accepted and changes nothing: Claw stores next_obs once.
- Batches are drawn from what the store has committed, which trails ``add`` by the ingest
  flush interval plus the prefetch and read-ahead queues. ``deterministic=True`` instead
  draws the k-th batch in this process, from exactly the steps added before the k-th
  ``sample()`` (flushed and committed first), with a stream seeded by ``(seed, k)``: seeded
  runs repeat, at the cost of a flush and a Redis read per ``sample()``.
- Without ``namespace``, each buffer gets its own (``<CLAW_NAMESPACE>-sb3-<random>``,
  logged): two runs never train on each other's data. ``reset()`` moves the buffer to a new
  namespace generation (``<namespace>.r<k>``) and leaves the old data in Redis unless
  ``drop_on_reset``.
- Pickling (``save_replay_buffer``, ``deepcopy``) keeps the connection settings, namespace,
  recipe and counters, never the data (it stays in Redis: keep the namespace) nor a
  password (URLs are saved without it; on load it comes from ``CLAW_REDIS_URL`` /
  ``CLAW_BROKER_URL`` when they name the same server). Loading reconnects.
- The seed of the recipe is ``seed``, else derived from numpy's global state, which SB3's
  ``set_random_seed`` sets before it builds the buffer: the algorithm's seed reaches it.
- Connections and threads are released by ``close()``, or when the buffer is garbage
  collected or the interpreter exits (SB3 never calls ``close``).
"""

from __future__ import annotations

import hashlib
import logging
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.preprocessing import get_obs_shape
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from claw_tasks.client import Episode, Ingestor
from claw_tasks.schema import FieldSpec, Schema
from claw_tasks.settings import load_settings, redact_url
from claw_tasks.store import Store
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.collate import collate
from orchestrator.delivery.readahead import ReadAhead
from orchestrator.delivery.wire import Batch
from orchestrator.maintenance.lifecycle import drop_namespace
from orchestrator.recipe.model import as_recipe
from orchestrator.sampling.sample import sample as sample_here

log = logging.getLogger(__name__)

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


def _without_password(url: str | None) -> str | None:
    """``url`` with its password removed (what a pickle may keep)."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = (parts.username or "") + "@" + parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=netloc if parts.username else netloc[1:]))


def _with_env_password(url: str | None, env_url: str) -> str | None:
    """A saved ``url`` again, with the environment's password when it names the same
    server (the password never travels in the pickle)."""
    if url is None or _without_password(env_url) != url:
        return url
    return env_url


def _global_seed() -> int:
    """A seed from numpy's global state without drawing from it: SB3 seeds that state
    before building the buffer, so the algorithm's seed decides this one."""
    state = np.random.get_state()
    digest = hashlib.blake2b(state[1].tobytes() + int(state[2]).to_bytes(4), digest_size=4)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


@dataclass(eq=False)
class _Connection:
    """What a buffer holds open on one namespace; closed once (``close``, reset, GC or exit)."""

    ingestor: Ingestor
    client: BatchClient
    episodes: list[Episode]
    pending: list[_Pending | None]
    names: dict[int, str] = field(default_factory=dict)  # batch size -> recipe name
    readaheads: dict[str, ReadAhead] = field(default_factory=dict)

    def write_pending(self) -> None:
        for i, held in enumerate(self.pending):
            if held is not None:
                held.write(explicit_next=True)
                self.pending[i] = None

    def close(self, timeout: float = 60.0) -> None:
        """Write what is pending, unregister this buffer's recipes, release connections."""
        try:
            self.write_pending()
            self.ingestor.close(timeout=timeout)
        finally:
            for ra in self.readaheads.values():
                ra.close()
            for name in self.names.values():
                self.client.unregister(name)
            self.client.close()


def _close_quietly(conn: _Connection) -> None:
    """The garbage-collection / exit path: bounded, and never raising at interpreter exit."""
    try:
        conn.close(timeout=10.0)
    except Exception as e:
        log.warning("closing a Claw replay buffer of namespace %r: %s: %s (steps not yet "
                    "committed may be lost; call close() to see it fail)",
                    conn.ingestor.namespace, type(e).__name__, e)  # fmt: skip


class ClawReplayBuffer(ReplayBuffer):
    """SB3 replay buffer backed by a Claw namespace (see the module docstring).

    ``recipe`` overrides keys of the default recipe (the fields above, one uniform source);
    ``batch_size`` always comes from ``sample``. ``capacity`` defaults to ``buffer_size +
    n_envs`` when the namespace is new. ``episode`` holds keyword arguments of
    :meth:`Ingestor.episode` (``task_id``, ``agent_id``, tags); ``ingest`` those of the
    :class:`Ingestor` (``flush_steps``, ``flush_interval``, ...). ``timeout`` bounds a pop.
    ``gradient_steps`` (the algorithm's) sizes the prefetch queue and the read-ahead in
    this process (``readahead`` batches, bounded by ``readahead_bytes``; 0 turns it off).
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
        seed: int | None = None,
        deterministic: bool = False,
        gradient_steps: int = 1,
        readahead: int | None = None,
        readahead_bytes: int = 64 << 20,
        drop_on_reset: bool = False,
    ) -> None:
        if isinstance(observation_space, spaces.Dict):
            raise TypeError("ClawReplayBuffer takes Box/Discrete/... observations; for Dict "
                            "ones use ClawDictReplayBuffer")  # fmt: skip
        # Not ReplayBuffer.__init__: it allocates the arrays Claw replaces.
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = optimize_memory_usage  # a no-op: next_obs stored once
        self.handle_timeout_termination = handle_timeout_termination
        self.obs_dtype = np.dtype(observation_space.dtype)
        self.action_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))
        settings = load_settings()
        if namespace is None:
            namespace = f"{settings.namespace}-sb3-{uuid.uuid4().hex[:10]}"
            log.info("ClawReplayBuffer: namespace %r (pass namespace= to choose one)", namespace)
        self.seed = _global_seed() if seed is None else int(seed)
        self.deterministic = deterministic
        depth = max(8, 2 * gradient_steps)
        if readahead is None:
            readahead = 0 if deterministic else max(2, min(gradient_steps, 256))
        self._init_kw: dict[str, Any] = {
            "buffer_size": buffer_size, "observation_space": observation_space,
            "action_space": action_space, "device": str(self.device), "n_envs": n_envs,
            "optimize_memory_usage": optimize_memory_usage,
            "handle_timeout_termination": handle_timeout_termination, "namespace": namespace,
            "redis_url": redis_url, "broker_url": broker_url, "recipe": dict(recipe or {}),
            "capacity": capacity, "episode": dict(episode or {}), "ingest": dict(ingest or {}),
            "timeout": timeout, "seed": self.seed, "deterministic": deterministic,
            "gradient_steps": gradient_steps, "readahead": readahead,
            "readahead_bytes": readahead_bytes, "drop_on_reset": drop_on_reset,
        }  # fmt: skip
        self.base_namespace = namespace
        self.generation = 0
        self.recipe = {
            "name": f"sb3-{uuid.uuid4().hex[:8]}",  # own recipes: closing one buffer of a
            "fields": FIELDS,  # namespace never unregisters another's
            "sources": [{"name": "all", "sampler": {"kind": "uniform"}}],
            "prefetch": {"depth": depth},
            "seed": self.seed,
            **(recipe or {}),
        }
        self.timeout = timeout
        self.readahead, self.readahead_bytes = readahead, readahead_bytes
        self._samples = 0  # sample() calls: the k of the deterministic stream
        self._connect()

    @property
    def namespace(self) -> str:
        return self.base_namespace if not self.generation else (
            f"{self.base_namespace}.r{self.generation}")  # fmt: skip

    def _connect(self) -> None:
        kw = self._init_kw
        redis_url, broker_url, namespace = kw["redis_url"], kw["broker_url"], self.namespace
        capacity = kw["capacity"]
        probe = Store(redis_url or load_settings().redis_url, namespace)
        exists = probe.exists()
        probe.r.close()
        if capacity is None and not exists:
            # One spare row per env: the ring's oldest row is incomplete once it wraps.
            capacity = kw["buffer_size"] + self.n_envs
        schema = Schema(
            fields={
                "obs": FieldSpec(self.obs_dtype.str, tuple(self.obs_shape)),
                "action": FieldSpec(self.action_dtype.str, (self.action_dim,)),
            }
        )
        ingest_kw = {"flush_steps": 256, "flush_interval": 0.25, **kw["ingest"]}
        # A commit of more steps than the ring holds keeps none of them (seen on main):
        # never send one.
        self._chunk = max(1, (capacity or kw["buffer_size"]) // 2)
        ingest_kw["flush_steps"] = min(ingest_kw["flush_steps"], self._chunk)
        if self.deterministic:  # only this buffer flushes, and waits: one commit order
            ingest_kw.update(flush_steps=1 << 30, flush_interval=None)
        self._unflushed = 0
        ingestor = Ingestor(
            namespace, redis_url, broker_url=broker_url, capacity=capacity, schema=schema,
            **ingest_kw,
        )  # fmt: skip
        client = BatchClient(namespace, redis_url, broker_url=broker_url)
        self._episode_kw = kw["episode"]
        self._conn = _Connection(
            ingestor, client, [ingestor.episode(**self._episode_kw) for _ in range(self.n_envs)],
            [None] * self.n_envs,
        )  # fmt: skip
        self._finalizer = weakref.finalize(self, _close_quietly, self._conn)

    @property
    def ingestor(self) -> Ingestor:
        return self._conn.ingestor

    @property
    def client(self) -> BatchClient:
        return self._conn.client

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
        conn = self._conn
        shape = (self.n_envs, *self.obs_shape)
        obs = np.array(obs, dtype=self.obs_dtype).reshape(shape)
        next_obs = np.array(next_obs, dtype=self.obs_dtype).reshape(shape)
        action = np.array(action, dtype=self.action_dtype).reshape(self.n_envs, self.action_dim)
        reward = np.asarray(reward, dtype=np.float32).reshape(self.n_envs)
        done = np.asarray(done).reshape(self.n_envs)
        for i in range(self.n_envs):
            held = conn.pending[i]
            if held is not None:
                held.write(explicit_next=not np.array_equal(held.next_obs, obs[i]))
            episode = conn.episodes[i]
            if not done[i]:
                conn.pending[i] = _Pending(
                    episode, obs[i], action[i], float(reward[i]), next_obs[i]
                )
                continue
            conn.pending[i] = None
            timeout = bool(infos[i].get("TimeLimit.truncated", False))
            episode.add(
                obs[i], action[i], float(reward[i]), next_obs=next_obs[i],
                terminated=not timeout, truncated=timeout,
            )  # fmt: skip
            conn.episodes[i] = conn.ingestor.episode(**self._episode_kw)
        self._unflushed += self.n_envs
        if self.deterministic and self._unflushed >= self._chunk:
            self.flush()  # in order: concurrent messages may commit in any order
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full, self.pos = True, 0

    def flush(self, timeout: float = 60.0) -> None:
        """Write every transition added so far (each env's newest with its next_obs) and
        wait until the store has committed them."""
        self._conn.write_pending()
        self._conn.ingestor.flush(wait=True, timeout=timeout)
        self._unflushed = 0

    def reset(self) -> None:
        """Start empty, as SB3's ``reset``: this buffer moves to a new namespace generation
        (the old one is dropped only with ``drop_on_reset``; other buffers' data is never
        touched). Steps added before and not yet flushed are written to the old one."""
        old = self.namespace
        self._finalizer()
        if self._init_kw["drop_on_reset"]:
            r = Store(self._conn.ingestor.redis_url, old).r  # the closed ones are gone
            drop_namespace(r, old)
            r.close()
        self.generation += 1
        super().reset()
        self._samples = 0
        self._connect()
        log.info("ClawReplayBuffer reset: namespace %r -> %r", old, self.namespace)

    # ---- sampling ------------------------------------------------------------------
    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """A batch of ``batch_size`` transitions, as SB3 samples them: prefetched and read
        ahead, or drawn here in the deterministic mode."""
        self._samples += 1
        if self.deterministic:
            return self.to_samples(self._sample_here(batch_size), env)
        name = self.recipe_name(batch_size)
        ra = self._conn.readaheads.get(name)
        batch = ra.pop(self.timeout) if ra is not None else self.client.pop(name, self.timeout)
        return self.to_samples(batch, env)

    def _sample_here(self, batch_size: int) -> Batch:
        """The k-th batch from the steps added before this k-th call, seeded by (seed, k)."""
        self.flush()
        spec = {**self.recipe, "batch_size": batch_size}
        rng = np.random.default_rng([self.seed, self._samples])
        got = sample_here(self.client.store, as_recipe(spec), rng=rng)
        arrays, meta = collate(got.fields)
        return Batch(arrays, got.ids, got.weights, got.source_index, got.sources,
                     got.recipe_version, meta)  # fmt: skip

    def recipe_name(self, batch_size: int) -> str:
        """The recipe serving ``batch_size``, registered on first use (after a flush, so
        everything added so far can be drawn), with its read-ahead thread."""
        conn = self._conn
        name = conn.names.get(batch_size)
        if name is None:
            self.flush()
            base = str(self.recipe["name"])
            name = f"{base}-{batch_size}" if conn.names else base
            spec = {**self.recipe, "name": name, "batch_size": batch_size}
            conn.names[batch_size] = name = self.client.register(spec).name
            if self.readahead:
                conn.readaheads[name] = ReadAhead(
                    self.client, name, count=self.readahead, max_bytes=self.readahead_bytes
                )
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
        """Flush, unregister this buffer's recipes, release connections (also done on
        garbage collection and at exit)."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self._conn.close()

    # ---- pickling (save_replay_buffer, deepcopy) ------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Settings, namespace, recipe (overrides and seed) and counters; never the data nor
        a password."""
        self.flush()  # what was added is in the store before anyone loads this
        kw = dict(self._init_kw)
        kw["redis_url"] = _without_password(kw["redis_url"])
        kw["broker_url"] = _without_password(kw["broker_url"])
        return {"init": kw, "generation": self.generation, "pos": self.pos,
                "full": self.full, "samples": self._samples}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        kw = dict(state["init"])
        settings = load_settings()
        kw["redis_url"] = _with_env_password(kw["redis_url"], settings.redis_url)
        kw["broker_url"] = _with_env_password(kw["broker_url"], settings.broker_url)
        generation = state["generation"]
        self.__init__(**kw)  # type: ignore[misc]  # own recipe names: see __init__
        if generation:  # reconnect to the generation the buffer was saved in
            self._finalizer()
            self.generation = generation
            self._connect()
        self.pos, self.full, self._samples = state["pos"], state["full"], state["samples"]
        log.info("ClawReplayBuffer: reconnected to namespace %r at %s", self.namespace,
                 redact_url(kw["redis_url"] or settings.redis_url))  # fmt: skip


class ClawDictReplayBuffer(ClawReplayBuffer):
    """SB3's ``DictReplayBuffer`` on Claw: for ``spaces.Dict`` observations (``MultiInputPolicy``).

    Each observation is stored as one uint8 row, the keys' arrays' bytes side by side (a
    Claw step has one ``obs`` field, and ``next_obs`` is still stored once); ``sample``
    unpacks them into SB3's ``DictReplayBufferSamples`` with every key's own dtype and shape.
    Takes the same options as :class:`ClawReplayBuffer`.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        **claw: Any,
    ) -> None:
        if not isinstance(observation_space, spaces.Dict):
            raise TypeError("ClawDictReplayBuffer is for Dict observations; use ClawReplayBuffer")
        self._layout: list[tuple[str, tuple[int, ...], np.dtype, int, int]] = []
        offset = 0
        for key, sub in observation_space.spaces.items():
            shape, dtype = tuple(get_obs_shape(sub)), np.dtype(sub.dtype)
            size = int(np.prod(shape)) * dtype.itemsize
            self._layout.append((key, shape, dtype, offset, size))
            offset += size
        packed = spaces.Box(0, 255, (offset,), np.uint8)
        super().__init__(buffer_size, packed, action_space, device, n_envs,
                         optimize_memory_usage, handle_timeout_termination, **claw)  # fmt: skip
        self.observation_space = observation_space
        self._init_kw["observation_space"] = observation_space  # pickles as it came

    def _pack(self, obs: Mapping[str, Any]) -> np.ndarray:
        n = self.n_envs
        parts = [np.ascontiguousarray(np.asarray(obs[key], dtype).reshape(n, *shape))
                 .reshape(n, -1).view(np.uint8)
                 for key, shape, dtype, _, _ in self._layout]  # fmt: skip
        return np.concatenate(parts, axis=1)

    def _unpack(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        n = len(rows)
        return {key: np.ascontiguousarray(rows[:, off : off + size]).view(dtype).reshape(n, *shape)
                for key, shape, dtype, off, size in self._layout}  # fmt: skip

    def add(  # type: ignore[override]
        self,
        obs: Mapping[str, np.ndarray],
        next_obs: Mapping[str, np.ndarray],
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        super().add(self._pack(obs), self._pack(next_obs), action, reward, done, infos)

    def to_samples(  # type: ignore[override]
        self, batch: Batch, env: VecNormalize | None = None
    ) -> DictReplayBufferSamples:
        flat = super().to_samples(batch)  # packed observations, no normalization yet
        obs = self._normalize_obs(self._unpack(batch["obs"]), env)
        next_obs = self._normalize_obs(self._unpack(batch["next_obs"]), env)
        rewards = flat.rewards
        if env is not None:
            rewards = self.to_torch(self._normalize_reward(flat.rewards.cpu().numpy(), env))
        return DictReplayBufferSamples(
            {k: self.to_torch(v) for k, v in obs.items()}, flat.actions,
            {k: self.to_torch(v) for k, v in next_obs.items()}, flat.dones, rewards,
            discounts=flat.discounts,
        )  # fmt: skip

"""``ClawReplayBuffer``: a Stable-Baselines3 ``ReplayBuffer`` whose data lives in Claw.

Use it as ``replay_buffer_class=ClawReplayBuffer`` of DQN, SAC or TD3, with Claw options in
``replay_buffer_kwargs`` (``namespace``, ``redis_url``, ``recipe`` overrides, ...).

``add`` ingests transitions through an :class:`~claw_tasks.client.Ingestor` (one episode
per env index, a new one after each ``done``; next_obs stored once, see
:mod:`orchestrator.adapters.transitions`).
``sample`` pops a prefetched batch of a recipe registered on first use (uniform over the
namespace unless overridden) and returns SB3's ``ReplayBufferSamples``: ``dones`` are the
terminations (timeouts bootstrap, as SB3's ``dones * (1 - timeouts)``), ``rewards`` have
shape (B, 1), observations and rewards go through ``VecNormalize`` when given. An n-step
recipe (``n_step > 1``) yields the n-step return, its ``done`` and ``discounts``.

Where it differs from SB3's buffer, and why:

- The parent's numpy arrays are never allocated; ``pos``, ``full`` and ``size()`` count the
  transitions this buffer added, capped at ``buffer_size`` like SB3's ring. The namespace's
  ring is SB3's (``buffer_size // n_envs`` positions of every env, stored time step by
  time step), so the rows it can sample are those SB3's buffer holds: exactly, in the
  deterministic mode; in the default one, those SB3's held when the newest committed add
  was made (ingest messages in flight at once may commit out of order, moving that edge
  by a few rows).
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
  password (see :mod:`orchestrator.adapters.sb3.state`). Loading reconnects.
- The seed of the recipe is ``seed``, else derived from numpy's global state, which SB3's
  ``set_random_seed`` sets before it builds the buffer: the algorithm's seed reaches it.
- Connections and threads are released by ``close()``, or when the buffer is garbage
  collected or the interpreter exits (SB3 never calls ``close``).
- Lineage: each ``sample()`` is recorded as training a policy version (``claw lineage NS
  --policy v``), by default ``updates``: the number of ``sample()`` calls so far, this one
  included. DQN, SAC and TD3 draw one sample per gradient step and add ``gradient_steps``
  to ``_n_updates`` after them, so the samples of version ``v`` trained the model whose
  ``_n_updates`` is ``v`` (the count is saved with the buffer; a buffer made for a model
  loaded mid-run starts at 0: pass ``policy_version`` then). ``timesteps`` records SB3's
  ``num_timesteps`` at the sample instead (the transitions added, ``n_envs`` per
  ``add``), so a version is every update between two environment steps. A callable gets
  the sample's number and returns the version (e.g. ``lambda k: model.num_timesteps``,
  set as ``buffer.policy_version`` once the model exists; not saved with the buffer);
  None records nothing.
"""

from __future__ import annotations

import functools
import logging
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.adapters.cadence import Cadence
from orchestrator.adapters.defaults import generation_namespace, global_seed, ingest_options
from orchestrator.adapters.link import BufferLink, close_quietly
from orchestrator.adapters.options import refuse_renamed
from orchestrator.adapters.sb3.state import SavedState
from orchestrator.adapters.transitions import Transitions
from orchestrator.adapters.versions import PolicyVersion, Versions
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.collate import collate
from orchestrator.maintenance.lifecycle import drop_namespace
from orchestrator.recipe.model import as_recipe
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.sample import sample as sample_here

log = logging.getLogger(__name__)

FIELDS = ["obs", "action", "reward", "next_obs", "terminated", "truncated"]


def _new_namespace() -> str:
    """A namespace of this buffer's own, when none is given."""
    namespace = f"{get_settings().namespace}-sb3-{uuid.uuid4().hex[:10]}"
    log.info("ClawReplayBuffer: namespace %r (pass namespace= to choose one)", namespace)
    return namespace


def _own_recipe(overrides: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The buffer's recipe: ``overrides`` over one uniform source of :data:`FIELDS`, under
    a name of its own (closing one buffer of a namespace never unregisters another's)."""
    recipe = {
        "name": f"sb3-{uuid.uuid4().hex[:8]}",
        "fields": FIELDS,
        "sources": [{"name": "all", "sampler": {"kind": "uniform"}}],
        "seed": seed,
        **overrides,
    }
    recipe.setdefault("layout", samples_layout(recipe))
    return recipe


def samples_layout(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's ``layout`` for SB3's samples: the done flags delivered as float32 (the
    observations, actions and rewards are stored in the dtypes SB3 returns), so
    :meth:`ClawReplayBuffer.to_samples` wraps every array as it arrives."""
    flags = [f for f in ("terminated", "truncated") if f in recipe.get("fields", ())]
    flags += ["done"] if int(recipe.get("n_step", 1)) > 1 else []
    return {"dtypes": {f: "float32" for f in flags}}


class ClawReplayBuffer(SavedState, ReplayBuffer):
    """SB3 replay buffer backed by a Claw namespace (see the module docstring).

    ``recipe`` overrides keys of the default recipe (the fields above, one uniform source);
    ``batch_size`` always comes from ``sample``. ``capacity`` defaults to SB3's window,
    ``buffer_size // n_envs * n_envs``, when the namespace is new. ``episode`` holds
    keyword arguments of :meth:`Ingestor.episode` (``task_id``, ``agent_id``, tags);
    ``ingest`` those of the :class:`Ingestor` (``flush_steps``, ``flush_interval``, ...).
    ``timeout`` bounds a pop.
    The burst of ``sample()`` calls between two ``add()`` s (the algorithm's
    ``gradient_steps``, which SB3 does not pass to its buffer) sizes the prefetch queue,
    the read-ahead in this process (``readahead`` batches, bounded by ``readahead_bytes``;
    0 turns it off) and how many ``sample()`` calls one prefetched batch serves
    (``batches_per_pop``, burst // 16 capped at 16: the recipe draws that many times
    ``batch_size`` rows and each call takes a ``batches_per_pop``-th of them — every
    ``batches_per_pop``-th row with several sources, to keep their mix — so the
    workers' and the read-ahead's per-batch costs are paid once per that many calls); see
    :func:`~orchestrator.adapters.cadence.plan_for`. By default the buffer watches the
    bursts and re-sizes itself when they change (the first burst runs with one batch per
    call); ``gradient_steps`` fixes the sizes from the start, ``readahead`` and
    ``batches_per_pop`` override them. The deterministic mode draws here: no read-ahead.
    ``policy_version``: what each sample is recorded as training (the module docstring,
    "Lineage").
    """

    @refuse_renamed
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
        gradient_steps: int | None = None,
        readahead: int | None = None,
        readahead_bytes: int = 64 << 20,
        batches_per_pop: int | None = None,
        drop_on_reset: bool = False,
        policy_version: PolicyVersion = "updates",
    ) -> None:
        self._init_sb3(buffer_size, observation_space, action_space, device, n_envs)
        self.optimize_memory_usage = optimize_memory_usage  # a no-op: next_obs stored once
        self.handle_timeout_termination = handle_timeout_termination
        namespace = _new_namespace() if namespace is None else namespace
        self.seed = global_seed() if seed is None else int(seed)
        self.deterministic = deterministic
        self._cadence = (
            Cadence(1, 1, 0)  # one batch per call, drawn here: nothing read ahead
            if deterministic
            else Cadence(gradient_steps, batches_per_pop, readahead)
        )
        self._init_kw: dict[str, Any] = {
            "buffer_size": buffer_size,
            "observation_space": observation_space,
            "action_space": action_space,
            "device": str(self.device),
            "n_envs": n_envs,
            "optimize_memory_usage": optimize_memory_usage,
            "handle_timeout_termination": handle_timeout_termination,
            "namespace": namespace,
            "redis_url": redis_url,
            "broker_url": broker_url,
            "recipe": dict(recipe or {}),
            "capacity": capacity,
            "episode": dict(episode or {}),
            "ingest": dict(ingest or {}),
            "timeout": timeout,
            "seed": self.seed,
            "deterministic": deterministic,
            "gradient_steps": gradient_steps,
            "readahead": readahead,
            "readahead_bytes": readahead_bytes,
            "batches_per_pop": batches_per_pop,
            "drop_on_reset": drop_on_reset,
            "policy_version": policy_version if isinstance(policy_version, str) else None,
        }
        self.updates = 0  # sample() calls since the buffer was made (saved; reset() keeps it)
        self.timesteps = 0  # transitions added (n_envs per add), as SB3's num_timesteps
        self.policy_version = policy_version
        self.base_namespace = namespace
        self.generation = 0
        self.recipe = _own_recipe(recipe or {}, self.seed)
        self.timeout = timeout
        self.readahead_bytes = readahead_bytes
        self._samples = 0  # sample() calls: the k of the deterministic stream
        self._connect()

    def _init_sb3(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str,
        n_envs: int,
    ) -> None:
        """SB3's side of the buffer: its spaces, device and window, without the arrays
        ``ReplayBuffer.__init__`` allocates (Claw holds the data)."""
        if isinstance(observation_space, spaces.Dict):
            raise TypeError(
                "ClawReplayBuffer takes Box/Discrete/... observations; for Dict "
                "ones use ClawDictReplayBuffer"
            )
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.obs_dtype = np.dtype(observation_space.dtype)
        self.action_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))

    @property
    def policy_version(self) -> PolicyVersion:
        """What each sample is recorded as training (see the module docstring)."""
        return self._versions.declare

    @policy_version.setter
    def policy_version(self, declare: PolicyVersion) -> None:
        self._versions = Versions(
            declare, {"updates": lambda: self.updates, "timesteps": lambda: self.timesteps}
        )

    @property
    def batches_per_pop(self) -> int:
        """``sample()`` calls one prefetched batch serves (see the class docstring)."""
        return self._cadence.plan.parts

    @property
    def readahead(self) -> int:
        """Prefetched batches decoded ahead in this process."""
        return self._cadence.plan.readahead

    @property
    def namespace(self) -> str:
        return generation_namespace(self.base_namespace, self.generation)

    def _connect(self) -> None:
        kw = self._init_kw
        redis_url, broker_url, namespace = kw["redis_url"], kw["broker_url"], self.namespace
        capacity = kw["capacity"]
        probe = Store(redis_url or get_settings().redis_url, namespace)
        exists = probe.exists()
        probe.r.close()
        if capacity is None and not exists:
            capacity = self.buffer_size * self.n_envs  # SB3's ring: positions x envs
        schema = Schema(
            fields={
                "obs": FieldSpec(self.obs_dtype.str, tuple(self.obs_shape)),
                "action": FieldSpec(self.action_dtype.str, (self.action_dim,)),
            }
        )
        self._chunk = max(1, (capacity or kw["buffer_size"]) // 2)
        ingest_kw = ingest_options(kw["ingest"], capacity or kw["buffer_size"])
        if self.deterministic:  # only this buffer flushes, and waits: one commit order
            ingest_kw.update(flush_steps=1 << 30, flush_interval=None)
        self._unflushed = 0
        ingestor = Ingestor(
            namespace,
            redis_url,
            broker_url=broker_url,
            capacity=capacity,
            schema=schema,
            **ingest_kw,
        )
        client = BatchClient(namespace, redis_url, broker_url=broker_url, readahead=0)
        self._link = BufferLink(ingestor, client, Transitions(ingestor, kw["episode"]))
        self._finalizer = weakref.finalize(self, close_quietly, self._link)
        self._link.start_readahead(self._cadence.plan)

    @property
    def ingestor(self) -> Ingestor:
        return self._link.ingestor

    @property
    def client(self) -> BatchClient:
        return self._link.client

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
        if (plan := self._cadence.added()) is not None:
            self._link.resize(plan)
        link = self._link
        shape = (self.n_envs, *self.obs_shape)
        obs = np.array(obs, dtype=self.obs_dtype).reshape(shape)
        next_obs = np.array(next_obs, dtype=self.obs_dtype).reshape(shape)
        action = np.array(action, dtype=self.action_dtype).reshape(self.n_envs, self.action_dim)
        reward = np.asarray(reward, dtype=np.float32).reshape(self.n_envs)
        done = np.asarray(done).reshape(self.n_envs)
        for i in range(self.n_envs):  # the previous time step first: the ring's order is SB3's
            link.transitions.release(i, obs[i])
        for i in range(self.n_envs):
            timeout = bool(done[i] and infos[i].get("TimeLimit.truncated", False))
            link.transitions.add(
                i,
                obs[i],
                action[i],
                float(reward[i]),
                next_obs[i],
                terminated=bool(done[i]) and not timeout,
                truncated=timeout,
            )
        self._unflushed += self.n_envs
        self.timesteps += self.n_envs
        if self.deterministic and self._unflushed >= self._chunk:
            self.flush()  # in order: concurrent messages may commit in any order
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full, self.pos = True, 0

    def flush(self, timeout: float = 60.0) -> None:
        """Write every transition added so far (each env's newest with its next_obs) and
        wait until the store has committed them."""
        self._link.flush(timeout)
        self._unflushed = 0

    def reset(self) -> None:
        """Start empty, as SB3's ``reset``: this buffer moves to a new namespace generation
        (the old one is dropped only with ``drop_on_reset``; other buffers' data is never
        touched). Steps added before and not yet flushed are written to the old one."""
        old = self.namespace
        self._finalizer()
        if self._init_kw["drop_on_reset"]:
            r = Store(self._link.ingestor.redis_url, old).r  # the closed ones are gone
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
        self.updates += 1
        version = self._versions.of(self.updates)
        if (plan := self._cadence.sampled()) is not None:
            self._link.resize(plan)
        if self.deterministic:
            batch = self._sample_here(batch_size)
            if version is not None:
                self.client.trained(str(self.recipe["name"]), batch, version)
            return self.to_samples(batch, env)
        name = self._link.names.get(batch_size) or self.recipe_name(batch_size)
        part, ready = self._link.pop(name, self.timeout, version)
        if env is None:
            return ready
        return self.to_samples(part if isinstance(part, Batch) else part(), env)

    def _sample_here(self, batch_size: int) -> Batch:
        """The k-th batch from the steps added before this k-th call, seeded by (seed, k)."""
        self.flush()
        spec = {**self.recipe, "batch_size": batch_size}
        rng = np.random.default_rng([self.seed, self._samples])
        got = sample_here(self.client.store, as_recipe(spec), rng=rng)
        arrays = collate(got.fields)
        return Batch(
            arrays,
            got.ids,
            got.weights,
            got.source_index,
            got.sources,
            got.recipe_version,
            got.meta,
        )

    def recipe_name(self, batch_size: int) -> str:
        """The recipe serving ``batch_size``, registered on first use (after a flush, so
        everything added so far can be drawn), with its read-ahead thread."""
        link, plan = self._link, self._cadence.plan
        base = str(self.recipe["name"]) + (f".p{link.replans}" if link.replans else "")
        name = f"{base}-{batch_size}" if link.names and batch_size not in link.names else base
        spec = {
            "prefetch": {"depth": plan.depth},
            **self.recipe,
            "name": name,
            "batch_size": batch_size * plan.parts,
        }
        return link.recipe(
            batch_size,
            spec,
            plan.readahead,
            self.readahead_bytes,
            plan.parts,
            convert=self._ready_samples,
            convert_parts=self._ready_parts,
        )

    def _ready_samples(self, part: Batch) -> tuple[Batch, ReplayBufferSamples]:
        """A part and its samples without ``VecNormalize`` (made in the read-ahead thread,
        so the trainer's ``sample()`` is a dequeue; with an env, ``sample`` converts the
        part itself, with the env's statistics of that moment)."""
        return part, self.to_samples(part)

    def _ready_parts(
        self, whole: Batch, parts: int
    ) -> list[tuple[Callable[[], Batch], ReplayBufferSamples]]:
        """:meth:`_ready_samples` of each part of ``whole`` (parts' rows contiguous): the
        tensors are made once for the batch and cut into the parts as views (a tensor per
        field and part cost ~5 us each: 40 a batch of 8 parts); each part's rows are taken
        only when ``sample`` is given an env."""
        m = len(whole) // parts
        cols = [_cut(t, m, parts) for t in self.to_samples(whole)]
        return [
            (functools.partial(whole.take, slice(j * m, (j + 1) * m)), self._samples_type(*c))
            for j, c in enumerate(zip(*cols, strict=True))
        ]

    def to_samples(self, batch: Batch, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """SB3's view of a Claw batch (:class:`ClawDictReplayBuffer` changes only how
        observations are turned into tensors): on the CPU, tensors over the delivered
        bytes (:meth:`tensor`), which the recipe's layout (:func:`samples_layout`) made
        SB3's dtypes; a batch in other dtypes is cast here."""
        if "done" in batch:  # n-step: termination within the m steps, discount gamma^m
            dones = _float32(batch["done"])
            discounts = self.tensor(batch["discount"].reshape(-1, 1))
        else:
            dones = _float32(batch["terminated"])
            if not self.handle_timeout_termination:
                dones = np.maximum(dones, _float32(batch["truncated"]))
            discounts = None
        return self._samples_type(
            self._observations(batch["obs"], env),
            self.tensor(batch["action"]),
            self._observations(batch["next_obs"], env),
            self.tensor(dones.reshape(-1, 1)),
            self.tensor(self._normalize_reward(batch["reward"].reshape(-1, 1), env)),
            discounts=discounts,
        )

    def tensor(self, array: np.ndarray) -> th.Tensor:
        """A batch's array as a tensor on the buffer's device: on the CPU a view of it when
        it is writable (a delivered batch's own bytes, or an array made for this batch),
        a copy of a read-only one."""
        if not array.flags.writeable:
            return th.tensor(array, device=self.device)
        t = th.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device)

    _samples_type: Any = ReplayBufferSamples

    def _observations(self, rows: np.ndarray, env: VecNormalize | None) -> Any:
        """A batch's observation rows as SB3 returns them (normalized, on the device)."""
        return self.tensor(self._normalize_obs(rows, env))

    def close(self) -> None:
        """Flush, unregister this buffer's recipes, release connections (also done on
        garbage collection and at exit)."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self._link.close()


def _float32(flags: np.ndarray) -> np.ndarray:
    """Done flags as float32 (as delivered by the recipe's layout, or cast here)."""
    return flags if flags.dtype == np.float32 else flags.astype(np.float32)


def _cut(value: Any, m: int, parts: int) -> Sequence[Any]:
    """A samples field of a whole batch as ``parts`` views of ``m`` rows (a tensor, a dict
    of them, or None)."""
    if value is None:
        return (None,) * parts
    if isinstance(value, dict):
        cut = [v.split(m) for v in value.values()]
        return [dict(zip(value, vals, strict=True)) for vals in zip(*cut, strict=True)]
    return value.split(m)

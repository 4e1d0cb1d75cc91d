"""``ClawRolloutBuffer``: a Stable-Baselines3 ``RolloutBuffer`` whose rollouts go through
Claw, for PPO and A2C (``rollout_buffer_class=ClawRolloutBuffer``; Claw options in
``rollout_buffer_kwargs``). :class:`ClawDictRolloutBuffer` takes ``spaces.Dict``
observations (``MultiInputPolicy``).

The algorithm's own loop runs unchanged:

- ``add`` (the collect loop) keeps the step's scalars here and writes its rows through an
  :class:`~claw_tasks.client.Ingestor` as on-policy steps (``Schema.rollout``: the
  behaviour's ``log_prob`` and ``value`` as tags, ``policy_version`` the rollout's
  number), one Claw episode per env episode, continued across rollouts. A row is written
  once the next ``add`` says whether its episode ended there, in one ``add_batch`` (one
  message) per ``write_every`` time steps (default: about ``MESSAGE_BYTES`` of payload a
  message; a small rollout in one), never a round trip per step. The calls to Claw
  (those messages, ``advance``) run in a :class:`Writer` thread, in order: the loop
  does not wait for their round trips.
- ``compute_returns_and_advantage`` writes each env's last row (terminated if ``dones``,
  else with ``bootstrap_value`` = SB3's ``last_values``) and computes SB3's numbers here
  with SB3's own code (``advantages``, ``returns``: what PPO's explained variance and
  callbacks read). Claw forms the rollout from the stored steps with the same GAE over
  the same chains (a ``rollout`` recipe, docs/recipes.md "On-policy"; equal to 1e-6,
  tested) and serves it with it: by default the ingest and prefetch workers, as every
  Claw write (a Celery task: Flower sees it, the workers' settings and limits apply).
  ``form_here=True`` is a trade-off the learner opts into: the rollout's last message is
  committed, and the rollout formed and served, in this process, with the ingest task's
  and the prefetch fill's own functions (:class:`~orchestrator.adapters.sb3.rollout_claw.
  CommitHere`, :func:`orchestrator.delivery.rollouts.form`: the same checks, commit, done
  record, version checks and lineage), without the broker hop and the worker task
  between SB3's last step and its rollout (most of the rollout path's time: 1.03-1.08x
  SB3's wall against 1.22x through the workers, docs/benchmarks.md). It gives up the
  Celery task (no task events, Flower does not see those messages), reads the ingest
  limits from the learner's environment, and spends the learner's CPU on the commit
  and the forming (the namespace's sampling index attached in this process, let go on
  ``close()``). A transient Redis error sends the message through the workers after
  all, and a recipe that augments its steps (``recipe``'s ``augment``) is formed by them.
- ``get(batch_size)`` (``train()``) yields one epoch of the rollout Claw served: all
  ``n_steps * n_envs`` steps with the advantages and returns Claw formed and the
  behaviour's log-probs and values, in SB3's minibatches (each step in exactly one
  minibatch per epoch; any ``batch_size``, A2C's ``None`` included). The rollout crosses
  Redis once, as one message holding its first epoch; epoch e is the same rows in the
  order the rollout mode serves epoch e (its seeded permutation, ``rollouts.permutation``
  of the seed and rollout number the message carries), so PPO's ``n_epochs`` (which SB3
  does not tell its buffer) cost no more transfers, and any number of ``get()`` calls
  works. The next ``reset()`` (SB3's next collect) moves the recipe's
  ``policy_version``: each rollout is consumed once.

Where it differs from SB3's buffer, and why:

- SB3 passes its buffer neither the episode ends' kind nor the final observation: it has
  already added ``gamma * V(final obs)`` to a timeout's reward (its timeout bootstrap,
  GitHub issue #633). So every episode end is stored ``terminated`` with SB3's reward,
  which makes the workers' GAE SB3's; the namespace is training data for this run, not
  a dataset with true terminal flags.
- Observations and actions are served from Claw, not from here (the rollout's own
  columns only hold them until they are sent): there are no ``observations`` and
  ``actions`` attributes. ``reset()`` after a rollout cut short (a
  callback that stops collecting) drops its rows not yet written; the written ones are
  never served (counted ``dropped_stale`` once the version moves).
- The epochs' shuffles are the recipe's (``seed``, else from numpy's global state, which
  SB3 seeds), not ``np.random.permutation``; they are over the rollout's chain order,
  which follows the run's unique episode ids, so runs do not repeat bit for bit.
- ``get()`` before ``compute_returns_and_advantage`` (SB3 allows it) first computes with
  zero last values and no ``dones``: a rollout reaches Claw whole.
- Without ``namespace`` each buffer gets its own (``<CLAW_NAMESPACE>-sb3-<random>``,
  logged); its ring holds ``capacity`` steps (default two rollouts: one served while the
  next is written). ``close()`` (or garbage collection, exit) unregisters the recipe and
  closes the connections; the steps stay in Redis. PPO's ``save`` leaves the rollout
  buffer out, as for SB3's own.
- Lineage: each rollout is recorded once, when it is popped, as training a policy
  version (``claw lineage NS --policy v``): by default ``rollouts``, the rollouts trained
  on so far, this one included: the weights this update makes are version v, the ones
  that collect the next rollout (whose steps carry ``policy_version`` v). ``timesteps``
  records the transitions added instead (SB3's ``num_timesteps``); a callable gets the
  rollout's number and returns the version; None records nothing.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections.abc import Generator, Mapping
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, RolloutBuffer
from stable_baselines3.common.type_aliases import RolloutBufferSamples

from claw_tasks.format.columns import StrColumn
from claw_tasks.format.message import IngestOutcome
from claw_tasks.format.schema import BOOTSTRAP_VALUE, LOG_PROB, VALUE, Schema
from claw_tasks.settings import get_settings
from orchestrator.adapters.defaults import global_seed
from orchestrator.adapters.options import refuse_renamed
from orchestrator.adapters.sb3.epochs import first_positions, minibatches, pop_rollout
from orchestrator.adapters.sb3.rollout_claw import (
    RUN_TAG,
    CommitHere,
    Writer,
    close_rollout,
    open_ingestor,
    rollout_recipe,
)
from orchestrator.adapters.versions import PolicyVersion, Versions
from orchestrator.delivery import rollouts
from orchestrator.delivery.client import BatchClient
from orchestrator.sampling.batch import Batch

log = logging.getLogger(__name__)

EPISODE_META = frozenset({"task_id", "agent_id", "skill_tag", "reward_source"})
EPISODE_TAGS = frozenset({LOG_PROB, VALUE, BOOTSTRAP_VALUE, RUN_TAG})


MESSAGE_BYTES = 4 << 20
"""Payload bytes per ``add_batch`` message, about: a small rollout (CartPole's 256 steps
are 6 KB) goes in one message, a large one (Atari's) in several sent while SB3 collects."""


def _numpy(x: Any, n: int) -> np.ndarray:
    """A tensor or array of ``n`` numbers as float32 (SB3's values and log-probs)."""
    if isinstance(x, th.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, np.float32).reshape(n)


class ClawRolloutBuffer(RolloutBuffer):
    """SB3 rollout buffer backed by Claw (see the module docstring).

    ``namespace``, ``redis_url``, ``broker_url`` say where; ``capacity`` the ring of a new
    namespace (steps; default two rollouts);
    ``episode`` holds keyword arguments of :meth:`Ingestor.episode` (``task_id``,
    ``agent_id``: on every step); ``ingest`` those of the :class:`Ingestor`;
    ``write_every`` the time steps per message (default: ``MESSAGE_BYTES`` of payload,
    at most the rollout);
    ``recipe`` overrides keys of the rollout recipe; ``timeout`` bounds a pop;
    ``policy_version`` what each rollout is recorded as training in the lineage log (the
    module docstring); ``form_here`` (opt-in) commits the rollout's last message and forms the
    rollout in this process instead of the workers (the module docstring: what it gains
    and gives up).
    """

    @refuse_renamed
    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        gae_lambda: float = 1,
        gamma: float = 0.99,
        n_envs: int = 1,
        *,
        namespace: str | None = None,
        redis_url: str | None = None,
        broker_url: str | None = None,
        capacity: int | None = None,
        episode: Mapping[str, Any] | None = None,
        ingest: Mapping[str, Any] | None = None,
        write_every: int | None = None,
        recipe: Mapping[str, Any] | None = None,
        seed: int | None = None,
        timeout: float | None = 60.0,
        policy_version: PolicyVersion = "rollouts",
        form_here: bool = False,
    ) -> None:
        self._init_sb3(buffer_size, observation_space, action_space, device, n_envs)
        self.gae_lambda, self.gamma = gae_lambda, gamma
        self.timeout = timeout
        row_bytes = int(np.prod(self._row_shape())) * self.obs_dtype.itemsize + 64
        per_step = max(1, MESSAGE_BYTES // (n_envs * row_bytes))
        self.write_every = max(1, min(write_every or per_step, buffer_size))
        self.steps = buffer_size * n_envs
        self._split_episode(dict(episode or {}))
        self._connect(namespace, redis_url, broker_url, capacity, ingest)
        self.seed = global_seed() if seed is None else int(seed)
        self.recipe_name = f"sb3ppo-{uuid.uuid4().hex[:8]}"
        self._overrides = dict(recipe or {})
        # An augmenting recipe is formed by the workers: its augmentation plans live there
        here = form_here and not self._overrides.get("augment")
        self._here = CommitHere(self.ingestor.store) if here else None
        self._run = uuid.uuid4().hex[:12]  # on every step; episode ids <run>.<env>.<number>
        self._ep_no = np.zeros(n_envs, np.int64)  # each env's current episode (from 1)
        self._open = np.zeros(n_envs, bool)  # whether it has one
        self._ep_step = np.zeros(n_envs, np.int64)  # its next step_index
        self.version = 0  # the rollout being collected: its steps' policy_version
        self.rollouts = 0  # rollouts popped (trained on) so far
        self.timesteps = 0  # transitions added (n_envs per add), as SB3's num_timesteps
        self._versions = Versions(
            policy_version, {"rollouts": lambda: self.rollouts, "timesteps": lambda: self.timesteps}
        )
        self.client.register(
            rollout_recipe(
                self.recipe_name,
                self.steps,
                self._run,
                self.version,
                self.gamma,
                self.seed,
                self.gae_lambda,
                self._overrides,
            )
        )
        self._names.append(self.recipe_name)
        self._clear()

    def _init_sb3(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str,
        n_envs: int,
    ) -> None:
        """SB3's side of the buffer: its spaces, device and window, without the arrays
        ``RolloutBuffer.__init__``'s ``reset()`` allocates (Claw holds the rows)."""
        if isinstance(self._row_space(observation_space), spaces.Dict):
            raise TypeError(
                "ClawRolloutBuffer takes Box/Discrete/... observations; for Dict ones use "
                "ClawDictRolloutBuffer"
            )
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs)
        self.generator_ready = False
        self.obs_dtype = np.dtype(self._row_space(observation_space).dtype)
        self.action_dtype = np.dtype(action_space.dtype)

    def _split_episode(self, episode: dict[str, Any]) -> None:
        """``episode``'s keywords as the steps' metadata and their tags; the tags the buffer
        writes itself are refused."""
        self.episode_kw = episode
        self._meta = {k: v for k, v in episode.items() if k in EPISODE_META}
        self._tags = {k: v for k, v in episode.items() if k not in EPISODE_META}
        if "policy_version" in episode or EPISODE_TAGS & set(self._tags):
            raise ValueError(
                f"episode: policy_version, {', '.join(sorted(EPISODE_TAGS))} are the "
                "buffer's to write"
            )

    def _connect(
        self,
        namespace: str | None,
        redis_url: str | None,
        broker_url: str | None,
        capacity: int | None,
        ingest: Mapping[str, Any] | None,
    ) -> None:
        """The Ingestor, BatchClient and writer thread on ``namespace`` (a new one of the
        buffer's own when None), closed together on garbage collection or exit."""
        if namespace is None:
            namespace = f"{get_settings().namespace}-sb3-{uuid.uuid4().hex[:10]}"
            log.info("ClawRolloutBuffer: namespace %r (pass namespace= to choose one)", namespace)
        self.namespace = namespace
        schema = Schema.rollout(
            tuple(self._row_shape()),
            (self.action_dim,),
            obs_dtype=self.obs_dtype.str,
            action_dtype=self.action_dtype.str,
            tags={RUN_TAG: "str"},
        )
        self.ingestor = open_ingestor(
            namespace, redis_url, broker_url, capacity, self.steps, schema, ingest
        )
        self.client = BatchClient(namespace, redis_url, broker_url=broker_url)
        self._names: list[str] = []  # the recipe, unregistered on close
        self.writer = Writer()
        self._finalizer = weakref.finalize(
            self, close_rollout, self.writer, self.ingestor, self.client, self._names
        )

    # ---- what the subclass for Dict observations changes -------------------------------
    def _row_space(self, observation_space: spaces.Space) -> spaces.Space:
        """The space of a stored ``obs`` row."""
        return observation_space

    def _row_shape(self) -> tuple[int, ...]:
        return tuple(self.obs_shape)

    def _rows(self, obs: Any) -> np.ndarray:
        """One time step's observations as the stored rows, ``(n_envs, *row_shape)``."""
        return np.asarray(obs).reshape(self.n_envs, *self._row_shape())  # cast when stored

    def _observations(self, rows: np.ndarray) -> Any:
        return self.to_torch(rows)

    _samples_type: Any = RolloutBufferSamples

    # ---- collecting --------------------------------------------------------------------
    def _clear(self) -> None:
        shape = (self.buffer_size, self.n_envs)
        self.rewards = np.zeros(shape, np.float32)
        self.returns = np.zeros(shape, np.float32)
        self.episode_starts = np.zeros(shape, np.float32)
        self.values = np.zeros(shape, np.float32)
        self.log_probs = np.zeros(shape, np.float32)
        self.advantages = np.zeros(shape, np.float32)
        # The rows as columns; a message holds a view of its time steps (never written
        # again: the next rollout gets fresh arrays while the writer may still send these)
        self._obs = np.empty((*shape, *self._row_shape()), self.obs_dtype)
        self._actions = np.empty((*shape, self.action_dim), self.action_dtype)
        self._written = 0  # time steps written to Claw
        self._finished = False  # the last row written (compute_returns_and_advantage)
        self._epoch: tuple[tuple[Any, ...], np.ndarray, int, int] | None = None  # popped
        self._epochs = 0  # get() calls of this rollout
        self.generator_ready = False
        self.pos, self.full = 0, False

    def reset(self) -> None:
        """Start the next rollout (SB3 calls this before collecting): its steps get the next
        ``policy_version``, which the recipe now serves. A rollout's rows not yet written
        are dropped (see the module docstring); nothing happens if nothing was added since
        the last reset."""
        if self.pos == 0 and not self.full:
            return
        if not self._finished:
            log.info(
                "ClawRolloutBuffer: rollout %d reset after %d of %d steps: its rows written "
                "are never served (dropped stale)",
                self.version,
                self.pos,
                self.buffer_size,
            )
            if self.pos > self._written:  # episodes carried on past the dropped rows
                self._episodes(self._written, self.pos)
        self.version += 1
        self.writer.submit(self.client.advance, self.recipe_name, self.version)
        self._clear()

    def add(
        self,
        obs: Any,
        action: np.ndarray,
        reward: np.ndarray,
        episode_start: np.ndarray,
        value: th.Tensor,
        log_prob: th.Tensor,
    ) -> None:
        """One time step of every env (SB3's shapes); the rows it completes go to Claw every
        ``write_every`` time steps."""
        if self.full:
            raise RuntimeError(
                f"the rollout holds {self.buffer_size} steps per env already: reset() first"
            )
        n, t = self.n_envs, self.pos
        self._obs[t] = self._rows(obs)
        self._actions[t] = np.asarray(action).reshape(n, self.action_dim)
        self.rewards[t] = np.asarray(reward, np.float32).reshape(n)
        self.episode_starts[t] = np.asarray(episode_start).reshape(n) != 0
        self.values[t] = _numpy(value, n)
        self.log_probs[t] = _numpy(log_prob, n)
        self.timesteps += n
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
        if t - self._written >= self.write_every:  # rows before t know how they end
            self._write(t)

    def _episodes(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's episode number and ``step_index`` for time steps ``start .. stop -
        1`` (``(k, n_envs)`` each), from the episode starts, with each env's episode
        carried on from the rows before: computed once per message, not per ``add``."""
        k, tpos = stop - start, np.arange(stop - start)[:, None]
        new = self.episode_starts[start:stop] != 0
        new[0] |= ~self._open  # an env's first row starts its first episode
        episode = self._ep_no + np.cumsum(new, axis=0)
        began = np.maximum.accumulate(np.where(new, tpos, -1), axis=0)  # last start so far
        step = np.where(began >= 0, tpos - began, self._ep_step + tpos)
        self._ep_no, self._ep_step = episode[k - 1].copy(), step[k - 1] + 1
        self._open[:] = True
        return episode, step

    def _write(
        self,
        stop: int,
        last_values: np.ndarray | None = None,
        dones: np.ndarray | None = None,
        now: bool = False,
    ) -> None:
        """Write time steps ``_written .. stop - 1`` in one message (by the writer thread;
        ``now``: here); with ``last_values`` and ``dones``, ``stop`` is the buffer's end
        and its last row ends the segment."""
        start, n = self._written, self.n_envs
        if stop <= start:
            return
        k = stop - start
        ended = np.zeros((k, n), bool)
        ended[: k - 1] = self.episode_starts[start + 1 : stop].astype(bool)
        boot = np.full((k, n), np.nan)
        if last_values is None:
            ended[k - 1] = self.episode_starts[stop].astype(bool)
        else:
            assert dones is not None
            ended[k - 1] = dones
            boot[k - 1] = np.where(dones, np.nan, last_values)
        episode, step = self._episodes(start, stop)
        # Episode ids as a vocabulary and codes: a string per episode, not per row
        keys, codes = np.unique(episode * n + np.arange(n), return_inverse=True)
        names = [f"{self._run}.{c % n}.{c // n}" for c in keys.tolist()]
        ids = StrColumn(names, codes.reshape(-1).astype(np.int32))
        columns = {
            "obs": self._obs[start:stop].reshape(k * n, *self._obs.shape[2:]),
            "action": self._actions[start:stop].reshape(k * n, self.action_dim),
            "reward": self.rewards[start:stop].ravel().copy(),
            "terminated": ended.ravel(),
            "episode_id": ids,
            "step_index": step.ravel(),
            "policy_version": self.version,
            "tags": {
                **self._tags,
                RUN_TAG: self._run,
                LOG_PROB: self.log_probs[start:stop].ravel().astype(np.float64),
                VALUE: self.values[start:stop].ravel().astype(np.float64),
                BOOTSTRAP_VALUE: boot.ravel(),
            },
            **self._meta,
        }
        if now:
            self.ingestor.add_batch(columns, deliver=self._here)
        else:
            self.writer.submit(self.ingestor.add_batch, columns)
        self._written = stop

    def compute_returns_and_advantage(self, last_values: th.Tensor, dones: np.ndarray) -> None:
        """Write the rollout's last rows (each env's segment ends: terminated if ``dones``,
        else bootstrapping with ``last_values``) and compute SB3's advantages and returns
        here, with SB3's code; the workers serve the same numbers with each minibatch.

        The last message is sent here, after SB3's numbers, not by the writer thread:
        ``get()`` waits for it next, and the two threads would only contend for the GIL
        meanwhile."""
        if not self.full:
            raise RuntimeError(
                f"compute_returns_and_advantage after {self.pos} of {self.buffer_size} steps "
                "per env: a rollout is written whole"
            )
        if self._finished:
            raise RuntimeError("this rollout's last rows are written already: reset() first")
        n = self.n_envs
        lv = _numpy(last_values, n)
        done = np.asarray(dones).reshape(n).astype(bool)
        super().compute_returns_and_advantage(th.as_tensor(lv), done)
        self.writer.wait(self.timeout)  # its messages first (they are in order)
        if self._here is not None:
            self._here.outcomes.clear()
        self._write(self.buffer_size, lv.astype(np.float64), done, now=True)
        self._finished = True  # the commit of these rows forms the rollout (no fill asked)
        if self._here is not None and self._here.outcomes:
            self._form_here(self._here.outcomes)

    def _form_here(self, outcomes: list[IngestOutcome]) -> None:
        """After the rollout's last message was committed here: what the ingest worker's
        commit hook would do next, here (form and serve the rollout once its steps are
        all committed; the fill's state recorded off this thread)."""
        refused = [o for o in outcomes if o.rejected or o.errors]
        if refused:
            raise RuntimeError(
                f"the store refused {sum(o.rejected for o in refused)} of the rollout's last "
                "steps: " + "; ".join(e for o in refused for e in o.errors)[:2000]
            )
        got = rollouts.form(self.client.registry, self.recipe_name)
        self.writer.submit(self._after_forming, None if got is None else got[1])

    def _after_forming(self, state: str | None) -> None:
        """Off SB3's thread: record this recipe's fill state, and form the namespace's
        other waiting rollout recipes, as the commit hook forms every one (another
        learner's recipe over these steps)."""
        reg = self.client.registry
        if state is not None:
            reg.bump(self.recipe_name, state=state)
        for name in rollouts.waiting(reg):
            if name != self.recipe_name and (got := rollouts.form(reg, name)) is not None:
                reg.bump(name, state=got[1])

    # ---- training ----------------------------------------------------------------------
    def get(self, batch_size: int | None = None) -> Generator[Any, None, None]:
        """The next epoch, as minibatches of ``batch_size`` (None: the whole rollout, as
        A2C asks): epoch e of the rollout mode's permutations (see the module
        docstring)."""
        assert self.full, ""
        if not self._finished:  # SB3 allows get() without it: nothing bootstraps then
            self.compute_returns_and_advantage(th.zeros(self.n_envs), np.zeros(self.n_envs))
        if self._epoch is None:  # its last rows were sent by compute_returns_and_advantage
            self._epoch = self._pop_rollout()
        data, first, seed, no = self._epoch
        e, self._epochs = self._epochs, self._epochs + 1
        yield from minibatches(
            self._samples_type, data, first, seed, no, e, batch_size, self.device
        )

    def _pop_rollout(self) -> tuple[tuple[Any, ...], np.ndarray, int, int]:
        """This rollout from Claw, as tensors in its first epoch's order, with where each
        chain position sits in it and the seed and number of its permutations."""
        batch, ro = pop_rollout(
            self.client, self.recipe_name, self.timeout, self.version, self.steps
        )
        self.rollouts += 1
        if (version := self._versions.of(self.rollouts)) is not None:
            self.client.trained(self.recipe_name, batch, version)
        seed, no = int(ro["seed"]), int(ro["no"])
        return self._samples(batch), first_positions(seed, no, self.steps), seed, no

    def _samples(self, batch: Batch) -> tuple[Any, ...]:
        """An epoch as SB3's tensors (the rows in the workers' order)."""
        return (
            self._observations(batch["obs"]),
            # SB3 casts actions to float32 (backward compatible; MultiBinary log-probs)
            self.to_torch(batch["action"].astype(np.float32, copy=False)),
            self.to_torch(batch["value"]),
            self.to_torch(batch["log_prob"]),
            self.to_torch(batch["advantages"]),
            self.to_torch(batch["returns"]),
        )

    def close(self) -> None:
        """Write nothing more, unregister the recipe, release the connections (also done on
        garbage collection and at exit)."""
        self._finalizer()

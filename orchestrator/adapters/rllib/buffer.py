"""``ClawEpisodeReplayBuffer``: RLlib's new-API-stack ``EpisodeReplayBuffer`` whose data lives
in Claw.

Use it in DQN as ``config.training(replay_buffer_config={"type":
"orchestrator.adapters.rllib.ClawEpisodeReplayBuffer", "capacity": ..., "namespace": ...})``
(a dotted string: RLlib's ``Algorithm`` checks ``"EpisodeReplayBuffer" in type``, which a
class object fails), or :class:`~orchestrator.adapters.rllib.ClawPrioritizedEpisodeReplayBuffer`
for prioritized replay. It subclasses RLlib's class, so the algorithm's checks and
``update_priorities_in_episode_replay_buffer`` treat it as RLlib's own.

``add`` writes the ``SingleAgentEpisode`` chunks the ``EnvRunner``s return through an
:class:`~claw_tasks.client.Ingestor` (:mod:`orchestrator.adapters.rllib.episodes`).
``sample(n_step=..., gamma=..., sample_episodes=True)``, what DQN and SAC call, pops a
prefetched batch of an n-step recipe registered on first use for that batch size, n and
gamma, and returns RLlib's 1-step episodes, converted in the read-ahead thread.

Where it differs from RLlib's buffer, and why:

- ``capacity`` is the namespace's ring (steps, as RLlib counts): Claw evicts the oldest
  steps, not whole episodes. A namespace that exists keeps its own capacity.
- n-step windows are cut at an episode's end and where its stored steps end (an ongoing
  chunk's last step), as RLlib's uniform buffer cuts them; ``n_step`` in the episode is
  the m steps the window summed, so ``gamma ** n_step`` is the target's discount exactly
  (RLlib's uniform buffer reports n for a cut window; its prioritized one draws again
  instead). ``n_step`` as a range ``(lo, hi)`` splits the rows evenly over lo..hi-1, one
  recipe per n (RLlib draws each row's n). Sequences (``batch_length_T``, stateful
  modules), infos and extra model outputs are not supported: they raise.
- Batches are drawn from what the store has committed, which trails ``add`` by the ingest
  flush interval and the prefetch and read-ahead queues. ``deterministic=True`` draws the
  k-th batch in this process from exactly the steps added before the k-th ``sample()``
  (flushed first), seeded by ``(seed, k)``.
- The seed is ``seed``, else derived from numpy's global state, which the algorithm's
  ``debugging(seed=...)`` sets before it builds the buffer (RLlib's own buffer is seeded by
  the OS).
- Without ``namespace`` each buffer gets its own (``<CLAW_NAMESPACE>-rllib-<random>``,
  logged). Give one to keep the data across restarts: a restored algorithm builds its
  buffer from the config again, on that namespace.
- ``get_state`` keeps the settings, namespace, recipe overrides, seed and counters; never
  the data (it stays in Redis) nor a password (it comes from ``CLAW_REDIS_URL`` /
  ``CLAW_BROKER_URL`` again in ``set_state`` when they name the same server). ``set_state``
  reconnects to the saved namespace.
- ``get_num_episodes`` counts the episodes this buffer started (eviction is per step, so
  an episode may be partly stored); ``get_num_timesteps`` the steps the ring holds.
- Connections and threads are released by ``close()``, on garbage collection, or at exit.
- Lineage: each ``sample()`` is recorded as training a policy version (``claw lineage NS
  --policy v``), by default ``updates``: the number of ``sample()`` calls so far, this one
  included. DQN (and SAC) run one learner update on each sample, so the samples of version
  ``v`` trained the ``v``-th update (the count is saved in ``get_state``: a restored run
  goes on counting). ``timesteps`` records the env steps added at the sample instead; a
  callable gets the sample's number and returns the version (e.g. ``lambda k:
  algo.training_iteration``, set as ``buffer.policy_version`` once the algorithm exists;
  not saved); None records nothing. A sample of an n-step range is one entry per n, each
  with the version.
"""

from __future__ import annotations

import logging
import uuid
import weakref
import zlib
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils import force_list
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

from claw_tasks.client import Ingestor
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.adapters.cadence import Cadence
from orchestrator.adapters.defaults import global_seed, ingest_options
from orchestrator.adapters.link import BufferLink, close_quietly
from orchestrator.adapters.options import refuse_renamed
from orchestrator.adapters.rllib.episodes import FIELDS, Drawn, EpisodeWriter, to_episodes
from orchestrator.adapters.rllib.metrics import add_metrics, sample_metrics
from orchestrator.adapters.rllib.sample_args import check_sample_request, n_step_rows
from orchestrator.adapters.rllib.state import SavedState
from orchestrator.adapters.transitions import Transitions
from orchestrator.adapters.versions import PolicyVersion, Versions
from orchestrator.delivery.client import BatchClient
from orchestrator.recipe.model import as_recipe
from orchestrator.sampling.sample import sample as sample_here

log = logging.getLogger(__name__)


class ClawEpisodeReplayBuffer(SavedState, EpisodeReplayBuffer):
    """RLlib episode replay buffer backed by a Claw namespace (see the module docstring).

    RLlib's arguments: ``capacity`` (steps), ``batch_size_B`` (used when ``sample`` gets
    no size), ``batch_length_T`` and ``metrics_num_episodes_for_smoothing``. Claw's:
    ``namespace``, ``redis_url``, ``broker_url``; ``recipe`` overrides keys of the
    recipe (fields, one source over the namespace); ``ingest`` holds :class:`Ingestor`
    options (``flush_steps``, ``flush_interval``, ...); ``timeout`` bounds a pop;
    ``seed``, ``deterministic``; ``gradient_steps`` (the ``sample()`` calls between two
    ``add()``s, DQN's training intensity), ``readahead``, ``readahead_bytes`` and
    ``batches_per_pop`` size the read-ahead as for the SB3 buffer (by default it watches
    the bursts: :class:`~orchestrator.adapters.cadence.Cadence`); ``policy_version``
    what each sample is recorded as training in the lineage log (``"updates"``,
    ``"timesteps"``, a callable or None: the module docstring). Other keyword
    arguments of RLlib's replay buffer config (``alpha``, ``beta`` of a prioritized
    default) are ignored, as RLlib's own buffer ignores them.
    """

    @refuse_renamed
    def __init__(
        self,
        capacity: int = 10000,
        *,
        batch_size_B: int = 16,
        batch_length_T: int = 1,
        metrics_num_episodes_for_smoothing: int = 100,
        namespace: str | None = None,
        redis_url: str | None = None,
        broker_url: str | None = None,
        recipe: Mapping[str, Any] | None = None,
        ingest: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
        seed: int | None = None,
        deterministic: bool = False,
        gradient_steps: int | None = None,
        readahead: int | None = None,
        readahead_bytes: int = 64 << 20,
        batches_per_pop: int | None = None,
        policy_version: PolicyVersion = "updates",
        **kwargs: Any,
    ) -> None:
        EpisodeReplayBuffer.__init__(  # not the MRO's next: a prioritized one builds trees
            self,
            capacity=capacity,
            batch_size_B=batch_size_B,
            batch_length_T=batch_length_T,
            metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing,
        )
        if namespace is None:
            namespace = f"{get_settings().namespace}-rllib-{uuid.uuid4().hex[:10]}"
            log.info(
                "%s: namespace %r (pass namespace= to choose one)", type(self).__name__, namespace
            )
        self.namespace = namespace
        self.seed = global_seed() if seed is None else int(seed)
        self.deterministic = deterministic
        self.timeout = timeout
        self.readahead_bytes = readahead_bytes
        self.overrides = dict(recipe or {})
        self._init_kw: dict[str, Any] = {
            "capacity": capacity,
            "batch_size_B": batch_size_B,
            "batch_length_T": batch_length_T,
            "metrics_num_episodes_for_smoothing": metrics_num_episodes_for_smoothing,
            "namespace": namespace,
            "redis_url": redis_url,
            "broker_url": broker_url,
            "recipe": self.overrides,
            "ingest": dict(ingest or {}),
            "timeout": timeout,
            "seed": self.seed,
            "deterministic": deterministic,
            "gradient_steps": gradient_steps,
            "readahead": readahead,
            "readahead_bytes": readahead_bytes,
            "batches_per_pop": batches_per_pop,
            "policy_version": policy_version if isinstance(policy_version, str) else None,
        }
        self.policy_version = policy_version
        self._cadence = (
            Cadence(1, 1, 0)  # one batch per call, drawn here: nothing read ahead
            if deterministic
            else Cadence(gradient_steps, batches_per_pop, readahead)
        )
        self._recipe_base = f"rllib-{uuid.uuid4().hex[:8]}"  # own names: closing one buffer
        self._samples = 0  # sample() calls: the k of the deterministic stream
        self._num_episodes_added = 0
        self._last_ids = np.zeros(0, np.int64)
        self._connect()

    @property
    def updates(self) -> int:
        """``sample()`` calls so far (saved by ``get_state``): the ``updates`` version."""
        return self._samples

    @property
    def policy_version(self) -> PolicyVersion:
        """What each sample is recorded as training (see the module docstring)."""
        return self._versions.declare

    @policy_version.setter
    def policy_version(self, declare: PolicyVersion) -> None:
        self._versions = Versions(
            declare,
            {"updates": lambda: self.updates, "timesteps": lambda: self._num_timesteps_added},
        )

    # ---- connection ----------------------------------------------------------------
    def _connect(self) -> None:
        kw = self._init_kw
        redis_url, broker_url = kw["redis_url"], kw["broker_url"]
        probe = Store(redis_url or get_settings().redis_url, self.namespace)
        exists = probe.exists()
        self._num_timesteps = int(probe.info()["steps"]) if exists else 0
        probe.r.close()
        ring = None if exists else int(self.capacity)
        ingest_kw = ingest_options(kw["ingest"], ring or int(self.capacity))
        if self.deterministic:  # only this buffer flushes, and waits: one commit order
            ingest_kw.update(flush_steps=1 << 30, flush_interval=None)
        ingestor = Ingestor(
            self.namespace, redis_url, broker_url=broker_url, capacity=ring, **ingest_kw
        )
        self.ring = ingestor.store.config().capacity
        client = BatchClient(self.namespace, redis_url, broker_url=broker_url, readahead=0)
        self._link = BufferLink(ingestor, client, Transitions(ingestor))
        self._writer = EpisodeWriter(ingestor)
        self._unflushed = 0
        self._finalizer = weakref.finalize(self, close_quietly, self._link)
        self._link.start_readahead(self._cadence.plan)

    @property
    def ingestor(self) -> Ingestor:
        return self._link.ingestor

    @property
    def client(self) -> BatchClient:
        return self._link.client

    def flush(self, timeout: float = 60.0) -> None:
        """Write every step added so far and wait until the store has committed them."""
        self._link.flush(timeout)
        self._unflushed = 0

    def close(self) -> None:
        """Flush, unregister this buffer's recipes, release connections (also done on
        garbage collection and at exit)."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self._link.close()

    # ---- writing -------------------------------------------------------------------
    def add(self, episodes: list[SingleAgentEpisode] | SingleAgentEpisode) -> None:
        """Write the episodes' steps (new episodes, or the next chunks of open ones)."""
        self._add(episodes, None)

    def _add(
        self, episodes: list[SingleAgentEpisode] | SingleAgentEpisode, priority: float | None
    ) -> None:
        if (plan := self._cadence.added()) is not None:
            self._link.resize(plan)
        steps = new = 0
        for eps in force_list(episodes):
            new += eps.id_ not in self._writer.open and eps.t_started == 0
            steps += self._writer.add(eps, priority)
        evicted = max(0, self._num_timesteps + steps - self.ring)
        self._num_timesteps = min(self.ring, self._num_timesteps + steps)
        self._num_timesteps_added += steps
        self._num_episodes_added += new
        self._unflushed += steps
        if self.deterministic and self._unflushed >= max(1, self.ring // 2):
            self.flush()  # in order: concurrent messages may commit in any order
        self._update_add_metrics(**add_metrics(new, steps, evicted))

    # ---- sampling ------------------------------------------------------------------
    def sample(
        self,
        num_items: int | None = None,
        *,
        batch_size_B: int | None = None,
        batch_length_T: int | None = None,
        n_step: int | tuple[int, int] | None = None,
        beta: float | None = 0.0,
        gamma: float = 0.99,
        include_infos: bool = False,
        include_extra_model_outputs: bool = False,
        sample_episodes: bool | None = True,
        to_numpy: bool = False,
        lookback: int = 0,
        min_batch_length_T: int = 0,
        **kwargs: Any,
    ) -> list[SingleAgentEpisode]:
        """``num_items`` (or ``batch_size_B``) n-step transitions as RLlib's 1-step
        episodes (see the module docstring for what is not supported)."""
        size, n, beta = check_sample_request(
            type(self).__name__,
            self.batch_size_B,
            num_items,
            batch_size_B,
            beta,
            n_step,
            batch_length_T,
            min_batch_length_T,
            include_infos,
            include_extra_model_outputs,
            sample_episodes,
        )
        drawn = self._draw(size, n, gamma, beta, self._next_version())
        self._last_ids = drawn.ids
        self.sampled_timesteps += size
        self._update_sample_metrics(**sample_metrics(drawn, size))
        return drawn.returned(to_numpy)

    def _next_version(self) -> Any:
        """Counts a ``sample()`` call: its policy version, after re-sizing the read-ahead
        when the bursts changed."""
        self._samples += 1
        version = self._versions.of(self._samples)
        if (plan := self._cadence.sampled()) is not None:
            self._link.resize(plan)
        return version

    def _draw(
        self,
        size: int,
        n: int | tuple[int, int],
        gamma: float,
        beta: float,
        version: Any,
        modules: tuple[str, ...] | None = None,
    ) -> Drawn:
        """``size`` rows (per module of ``modules``, for the multi-agent buffer), each part
        recorded in the lineage log as training ``version`` (None: not recorded)."""
        parts = []
        for k, rows in n_step_rows(size, n):  # one n, or a range: rows per n
            if self.deterministic:
                parts.append(self._draw_here(rows, k, gamma, beta, version, modules))
            else:
                name = self._recipe_name(rows, k, gamma, beta, modules)
                parts.append(self._link.pop(name, self.timeout, version))
        return Drawn.join(parts)

    def _source(self, beta: float) -> dict[str, Any]:
        """The recipe source's sampler (the prioritized buffer's is ``priority``)."""
        return {"kind": "uniform"}

    def _spec(
        self, size: int, n: int, gamma: float, beta: float, modules: tuple[str, ...] | None = None
    ) -> dict[str, Any]:
        """The recipe of these arguments (``modules``: the multi-agent buffer's)."""
        return {
            "name": self._recipe_base,
            "fields": FIELDS,
            "sources": [{"name": "all", "sampler": self._source(beta)}],
            "seed": self.seed,
            "n_step": n,
            "gamma": gamma,
            **self.overrides,
            "batch_size": size,
        }

    def _convert(self, n: int, gamma: float, modules: tuple[str, ...] | None = None) -> Any:
        writer = self._writer

        def convert(batch: Any) -> Drawn:
            spaces = (writer.observation_space, writer.action_space)
            return to_episodes(batch, n, gamma, spaces)

        return convert

    def _recipe_name(
        self, size: int, n: int, gamma: float, beta: float, modules: tuple[str, ...] | None = None
    ) -> str:
        """The recipe serving these arguments, registered on first use (after a flush, so
        everything added so far can be drawn), with its read-ahead thread."""
        link, plan = self._link, self._cadence.plan
        key: Hashable = (size, n, float(gamma), beta, modules)
        name = self._recipe_base + (f".p{link.replans}" if link.replans else "")
        if link.names and key not in link.names:
            name += f"-{len(link.names)}"
        spec = {
            "prefetch": {"depth": plan.depth},
            **self._spec(size * plan.parts, n, gamma, beta, modules),
            "name": name,
        }
        return link.recipe(
            key,
            spec,
            plan.readahead,
            self.readahead_bytes,
            plan.parts,
            convert=self._convert(n, gamma, modules),
        )

    def _draw_here(
        self,
        size: int,
        n: int,
        gamma: float,
        beta: float,
        version: Any,
        modules: tuple[str, ...] | None,
    ) -> Drawn:
        """The k-th batch from the steps added before this k-th call, seeded by (seed, k)
        (and n, for each n of a range, and the modules)."""
        self.flush()
        seed = [self.seed, self._samples, n]
        if modules is not None:
            seed.append(zlib.crc32("\0".join(modules).encode()))
        spec = self._spec(size, n, gamma, beta, modules)
        batch = sample_here(self.client.store, as_recipe(spec), rng=np.random.default_rng(seed))
        if version is not None:
            self.client.trained(self._recipe_base, batch, version)
        return self._convert(n, gamma, modules)(batch)

    # ---- counts --------------------------------------------------------------------
    def get_num_episodes(self, module_id: str | None = None) -> int:
        """Episodes this buffer started (see the module docstring)."""
        return self._num_episodes_added

    def get_num_episodes_evicted(self, module_id: str | None = None) -> int:
        """Always 0: the ring evicts steps, not episodes."""
        return 0

    def get_num_timesteps(self, module_id: str | None = None) -> int:
        """Steps the namespace's ring holds (counted here: this buffer's adds, capped)."""
        return self._num_timesteps

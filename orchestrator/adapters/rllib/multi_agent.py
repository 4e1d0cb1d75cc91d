"""``ClawMultiAgentEpisodeReplayBuffer``: RLlib's new-API-stack ``MultiAgentEpisodeReplayBuffer``
whose data lives in Claw, as the joint-step records of multi-agent data
(:mod:`claw_tasks.format.joint`, the layout ``RecordParallelSteps`` writes for PettingZoo).

Use it in a multi-agent DQN as ``replay_buffer_config={"type":
"orchestrator.adapters.rllib.ClawMultiAgentEpisodeReplayBuffer", ...}`` (the arguments of
:class:`~orchestrator.adapters.rllib.ClawEpisodeReplayBuffer`).

``add`` takes the ``MultiAgentEpisode`` chunks a ``MultiAgentEnvRunner`` returns. Each agent's
steps of an episode are the Claw episode ``<episode id>/<agent>`` (``agent_id`` the agent as
text), its step ``(o_k, a_k, r_k)`` stored with ``step_index`` the env timestep of ``o_k``,
``tags.joint_episode`` the episode and ``tags.rllib_module`` the module the episode mapped the
agent to, ``tags.rllib_t`` the step's index in the agent's episode. The records of one env
timestep are a joint step: its first agent (in the order
agents were first seen) is the anchor, with ``tags.joint_agents``, so joint recipes
(``joint: {agents: [...]}``, CTDE critics) read what RLlib's learners trained on.

``sample()`` in RLlib's default ``replay_mode="independent"`` (what DQN uses) draws
``num_items`` n-step transitions per module (``modules_to_sample``, default every module
added) from that module's records (one recipe for the modules of a sample: each source once
per module, a fixed mixture, so one popped batch serves the sample), and returns RLlib's
1-step ``SingleAgentEpisode``s with ``agent_id``, ``module_id`` and
``multi_agent_episode_id`` set, module after module, as RLlib's buffer does; the learner
connector batches them per module.

Where it differs from RLlib's buffer, and why (beyond the single-agent buffer's list):

- ``capacity`` counts records (agent steps): the ring evicts the oldest agent steps. RLlib's
  counts env steps and evicts whole episodes. A joint step one of whose records went is
  partial: joint recipes skip it; per-module samples draw the records that are left.
- An n-step window runs over an agent's consecutive env timesteps: an agent that acts at
  every env step (simultaneous moves, MultiAgentCartPole, PettingZoo parallel envs) gets
  n-step windows as RLlib's; one that skips env steps (turn-based games) gets 1-step rows
  (each step's ``next_obs`` is stored, so they are exact 1-step transitions). RLlib's
  windows count agent steps. A window cut at an episode's end reports its m (RLlib's
  multi-agent buffer draws such rows again).
- ``replay_mode="synchronized"`` is not served (RLlib's returns per-module column dicts
  whose ``weights`` and ``n_step`` are empty and no algorithm of the new stack asks for
  it): a joint recipe over the namespace (``BatchClient``) serves synchronized joint steps.
- No global state is stored: a ``MultiAgentEpisode`` has none. An agent step recorded in a
  later chunk than another agent's step of the same env timestep (a turn-based agent whose
  step was still open when the chunk was cut) makes that joint step partial.
- Prioritized multi-agent replay (RLlib's ``MultiAgentPrioritizedEpisodeReplayBuffer``) is
  not provided.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.utils import force_list
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import (
    MultiAgentEpisodeReplayBuffer,
)

from claw_tasks.client import Episode, Ingestor
from claw_tasks.format.joint import AGENTS_TAG, EPISODE_TAG, agent_episode, joint_code
from orchestrator.adapters.rllib.buffer import ClawEpisodeReplayBuffer
from orchestrator.adapters.rllib.episodes import FIELDS, Drawn, to_episodes
from orchestrator.adapters.rllib.metrics import multi_agent_sample_metrics
from orchestrator.adapters.rllib.sample_args import check_sample_request

MODULE_TAG = "rllib_module"
"""String tag on every record: the RLlib module its agent was mapped to."""

AGENT_T_TAG = "rllib_t"
"""Numeric tag on every record: the step's index in its agent's RLlib episode (``step_index``
is the env timestep, the joint key; they differ for agents that join late or skip steps)."""

SKIP = MultiAgentEpisode.SKIP_ENV_TS_TAG


class MultiAgentWriter:
    """``MultiAgentEpisode`` chunks into one Ingestor (see the module docstring); keeps the
    Claw episode of each open (episode, agent), the ``max_open`` newest episodes' worth."""

    def __init__(self, ingestor: Ingestor, max_open: int = 10_000) -> None:
        self.ingestor = ingestor
        self.max_open = max_open
        self.open: dict[str, dict[str, Episode]] = {}  # episode id -> agent -> writer
        self.written: dict[str, int] = {}  # episode id -> the newest env timestep written
        self.order: dict[str, int] = {}  # agent (as text) -> first seen
        self.agents: dict[str, Hashable] = {}  # agent as text -> RLlib's id
        self.spaces: dict[str, tuple[gym.Space | None, gym.Space | None]] = {}  # per module

    def add(self, ma: MultiAgentEpisode) -> dict[tuple[str, str], int]:
        """Write the chunk's agent steps; returns steps written per (agent, module)."""
        name = str(ma.id_)
        rows = []  # (env t, agent, module, k, its SingleAgentEpisode, its env timesteps)
        for aid, sa in ma.agent_episodes.items():
            n = len(sa)
            agent = str(aid)
            module = str(ma.module_for(aid) or DEFAULT_MODULE_ID)
            self.agents.setdefault(agent, aid)
            self.order.setdefault(agent, len(self.order))
            if sa.observation_space is not None:
                self.spaces[module] = (sa.observation_space, sa.action_space)
            if n == 0:
                continue
            if isinstance(sa.get_observations(0), dict) or isinstance(sa.get_actions(0), dict):
                raise TypeError(
                    f"{type(self).__name__} stores array observations and actions per agent; "
                    "flatten Dict/Tuple spaces with a connector first"
                )
            env_t = env_timesteps(ma, aid, sa.t_started, n)
            rows.extend((int(env_t[k]), agent, module, k, sa, env_t) for k in range(n))
        rows.sort(key=lambda r: (r[0], self.order[r[1]]))
        before = self.written.get(name, -1)
        present: dict[int, int] = defaultdict(int)
        for t, *_ in rows:
            present[t] += 1
        writers = self.open.pop(name, {})
        code = joint_code(name)
        done: dict[tuple[str, str], int] = defaultdict(int)
        anchored: set[int] = set()
        for t, agent, module, k, sa, env_t in rows:
            ep = writers.get(agent)
            if ep is None:
                ep = writers[agent] = self.ingestor.episode(
                    agent_episode(name, agent),
                    agent_id=agent,
                    **{EPISODE_TAG: code, MODULE_TAG: module},
                )
            n = len(sa)
            last = k == n - 1
            follows = not last and int(env_t[k + 1]) == t + 1
            tags: dict[str, Any] = {AGENT_T_TAG: float(sa.t_started + k)}
            if t > before and t not in anchored:  # the anchor: first present at t
                anchored.add(t)
                tags[AGENTS_TAG] = float(present[t])
            ep.step_index = t
            ep.add(
                np.asarray(sa.get_observations(k)),
                np.asarray(sa.get_actions(k)),
                float(sa.get_rewards(k)),
                next_obs=None if follows else np.asarray(sa.get_observations(k + 1)),
                terminated=last and bool(sa.is_terminated),
                truncated=last and bool(sa.is_truncated) and not sa.is_terminated,
                **tags,
            )
            done[agent, module] += 1
            if last and (sa.is_done or ma.is_done):
                writers.pop(agent).end()
        if rows:
            self.written[name] = max(before, rows[-1][0])
        if ma.is_done:
            for ep in writers.values():
                ep.end()
            self.written.pop(name, None)
        elif writers or name in self.written:
            self.open[name] = writers
            while len(self.open) > self.max_open:  # the oldest go first
                old = next(iter(self.open))
                del self.open[old]
                self.written.pop(old, None)
        return dict(done)


def env_timesteps(ma: MultiAgentEpisode, aid: Hashable, t0: int, n: int) -> np.ndarray:
    """The env timestep of each of agent ``aid``'s observations ``t0 .. t0 + n - 1`` in the
    chunk ``ma`` (where it took the action of that step): from ``env_t_to_agent_t``, whose
    lookback holds the env steps before the chunk."""
    mapping = ma.env_t_to_agent_t[aid]
    first = ma.env_t_started - mapping.lookback
    out = np.full(n, -1, np.int64)
    for j, k in enumerate(mapping.data):
        if k != SKIP and t0 <= k < t0 + n and out[k - t0] < 0:
            out[k - t0] = first + j
    if (out < 0).any():
        raise ValueError(
            f"MultiAgentEpisode {ma.id_!r}: agent {aid!r}'s steps {t0}..{t0 + n - 1} are not "
            "all in its env_t_to_agent_t mapping"
        )
    return out


class ClawMultiAgentEpisodeReplayBuffer(ClawEpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer):
    """RLlib multi-agent episode replay buffer backed by a Claw namespace (see the module
    docstring); the arguments are :class:`~orchestrator.adapters.rllib.ClawEpisodeReplayBuffer`'s.

    It subclasses RLlib's multi-agent buffer so that RLlib treats it as one; none of that
    class's episode lists or indices are built."""

    def __init__(self, capacity: int = 10000, **kwargs: Any) -> None:
        self._modules: dict[str, dict[str, int]] = {}  # module -> counters
        self._agent_steps_added = 0
        ClawEpisodeReplayBuffer.__init__(self, capacity, **kwargs)

    def _connect(self) -> None:
        super()._connect()
        self._ma_writer = MultiAgentWriter(self.ingestor)

    def _module(self, module: str) -> dict[str, int]:
        return self._modules.setdefault(module, {"added": 0, "episodes": 0, "sampled": 0})

    # ---- writing -------------------------------------------------------------------
    def add(self, episodes: list[MultiAgentEpisode] | MultiAgentEpisode) -> None:  # type: ignore[override]  # RLlib's add takes a batch: ours episodes, as RLlib's episode buffers
        """Write the multi-agent episodes' agent steps (new episodes, or the next chunks of
        open ones)."""
        if (plan := self._cadence.added()) is not None:
            self._link.resize(plan)
        writer = self._ma_writer
        env_steps = new = 0
        agents: dict[str, int] = defaultdict(int)
        modules: dict[str, int] = defaultdict(int)
        new_agents: dict[str, int] = defaultdict(int)
        new_modules: dict[str, int] = defaultdict(int)
        for ma in force_list(episodes):
            if not isinstance(ma, MultiAgentEpisode):
                raise TypeError(
                    f"{type(self).__name__}.add takes MultiAgentEpisodes, not "
                    f"{type(ma).__name__} (single-agent: ClawEpisodeReplayBuffer)"
                )
            fresh = str(ma.id_) not in writer.open and ma.env_t_started == 0
            new += fresh
            env_steps += ma.env_steps()
            for (agent, module), k in writer.add(ma).items():
                agents[agent] += k
                modules[module] += k
                self._module(module)["added"] += k
            if fresh:
                for aid in ma.agent_episodes:
                    module = str(ma.module_for(aid) or DEFAULT_MODULE_ID)
                    self._module(module)["episodes"] += 1
                    new_agents[str(aid)] += 1
                    new_modules[module] += 1
        steps = sum(agents.values())
        evicted = max(0, self._num_timesteps + steps - self.ring)
        self._num_timesteps = min(self.ring, self._num_timesteps + steps)
        self._num_timesteps_added += env_steps
        self._agent_steps_added += steps
        self._num_episodes_added += new
        self._unflushed += steps
        if self.deterministic and self._unflushed >= max(1, self.ring // 2):
            self.flush()
        self._update_add_metrics(
            num_episodes_added=new,
            num_env_steps_added=env_steps,
            num_episodes_evicted=0,
            num_env_steps_evicted=evicted,
            agent_to_num_episodes_added=dict(new_agents),
            agent_to_num_steps_added=dict(agents),
            agent_to_num_episodes_evicted={},
            agent_to_num_steps_evicted={},
            module_to_num_episodes_added=dict(new_modules),
            module_to_num_steps_added=dict(modules),
            module_to_num_episodes_evicted={},
            module_to_num_steps_evicted={},
        )

    # ---- sampling ------------------------------------------------------------------
    def sample(  # type: ignore[override]  # RLlib's multi-agent sample signature, which its base class lacks
        self,
        num_items: int | None = None,
        *,
        batch_size_B: int | None = None,
        batch_length_T: int | None = None,
        n_step: int | tuple[int, int] | None = 1,
        gamma: float = 0.99,
        include_infos: bool = False,
        include_extra_model_outputs: bool = False,
        replay_mode: str = "independent",
        modules_to_sample: list[str] | None = None,
        beta: float | None = 0.0,
        sample_episodes: bool | None = True,
        to_numpy: bool = False,
        lookback: int = 0,
        min_batch_length_T: int = 0,
        **kwargs: Any,
    ) -> list[Any]:
        """``num_items`` (or ``batch_size_B``) n-step transitions per module, as RLlib's
        1-step episodes, module after module (see the module docstring)."""
        if replay_mode != "independent":
            raise NotImplementedError(
                f"{type(self).__name__}: replay_mode={replay_mode!r} is not served; "
                "synchronized joint steps come from a joint recipe over the namespace "
                "(joint: {agents: [...]}, through BatchClient)"
            )
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
        modules = [str(m) for m in (modules_to_sample or self._modules)]
        unknown = [m for m in modules if m not in self._modules]
        if unknown:
            raise KeyError(f"modules_to_sample: no steps added for {unknown}")
        if not modules:  # nothing added yet: RLlib's returns no rows either
            return []
        drawn = self._draw(size, n, gamma, beta, self._next_version(), tuple(modules))
        for module in modules:
            self._module(module)["sampled"] += size
        self._last_ids = np.zeros(0, np.int64)
        self.sampled_timesteps += size
        self._update_sample_metrics(**multi_agent_sample_metrics(drawn))
        return drawn.returned(to_numpy)

    def _spec(
        self, size: int, n: int, gamma: float, beta: float, modules: tuple[str, ...] | None = None
    ) -> dict[str, Any]:
        """One recipe for the modules of a sample: each source once per module (filtered on
        its records), so a batch holds ``size`` rows per module, one module after another
        (a fixed mixture: each source's share is exact)."""
        modules = modules or ()
        spec = super()._spec(size * len(modules), n, gamma, beta)
        spec["fields"] = [*FIELDS, "agent_id", f"tags.{AGENT_T_TAG}"]
        spec["sources"] = [
            _of_module(s, f"{s.get('name', 'source')}.{i}", i)
            for i in range(len(modules))
            for s in spec["sources"]
        ]
        mine = {f"{MODULE_TAG}_{i}": m for i, m in enumerate(modules)}
        spec["params"] = {**spec.get("params", {}), **mine}  # the overrides' own stay as given
        return spec

    def _convert(self, n: int, gamma: float, modules: tuple[str, ...] | None = None) -> Any:
        writer = self._ma_writer
        modules = modules or ()
        per_module = len(super()._spec(1, 1, 0.5, 0.0)["sources"])  # sources of one module

        def convert(batch: Any) -> Drawn:
            agents = batch.meta["agent_id"]
            module = np.asarray(batch.source_index) // per_module
            ids = [
                {
                    "agent_id": writer.agents.get(a, a),
                    "module_id": modules[m],
                    "multi_agent_episode_id": name[: -len(a) - 1],
                }
                for a, name, m in zip(
                    agents, batch.meta["episode_id"], module.tolist(), strict=True
                )
            ]
            out = to_episodes(batch, n, gamma, (None, None), ids, batch[f"tags.{AGENT_T_TAG}"])
            for e in out.episodes:  # each module's spaces
                e.observation_space, e.action_space = writer.spaces.get(e.module_id, (None, None))
            return out

        return convert

    # ---- counts --------------------------------------------------------------------
    def get_module_ids(self) -> list[str]:
        """The modules steps were added for."""
        return list(self._modules)

    def get_num_agent_timesteps(self) -> int:
        """Agent steps (records) the namespace's ring holds (counted here, capped)."""
        return self._num_timesteps

    def get_added_agent_timesteps(self) -> int:
        """Agent steps added over this buffer's life."""
        return self._agent_steps_added

    def get_num_episodes(self, module_id: str | None = None) -> int:
        """Episodes (a module's: agent episodes) this buffer started."""
        if module_id is None:
            return self._num_episodes_added
        return self._modules.get(str(module_id), {}).get("episodes", 0)

    def get_num_episodes_evicted(self, module_id: str | None = None) -> int:
        """Always 0: the ring evicts steps, not episodes."""
        return 0

    def get_num_timesteps(self, module_id: str | None = None) -> int:
        """Agent steps the ring holds; a module's: its live records in the store (a count
        over the namespace, after a flush)."""
        if module_id is None:
            return self._num_timesteps
        self.flush()
        return self.client.store.count({f"tags.{MODULE_TAG}": str(module_id)})

    def get_sampled_timesteps(self, module_id: str | None = None) -> int:
        if module_id is None:
            return self.sampled_timesteps
        return self._modules.get(str(module_id), {}).get("sampled", 0)

    def get_added_timesteps(self, module_id: str | None = None) -> int:
        """Env steps added; a module's: its agent steps added."""
        if module_id is None:
            return self._num_timesteps_added
        return self._modules.get(str(module_id), {}).get("added", 0)

    # ---- state ---------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The single-agent buffer's state, with the modules' counters and the agents'
        ids (RLlib's, which may be ints)."""
        state = super().get_state()
        w = self._ma_writer
        state["claw"]["modules"] = {m: dict(c) for m, c in self._modules.items()}
        state["claw"]["agent_steps_added"] = self._agent_steps_added
        state["claw"]["agents"] = [[a, w.agents[a]] for a in w.order]
        return state

    def set_state(self, state: Mapping[str, Any]) -> None:
        super().set_state(state)
        saved = state["claw"]
        self._modules = {str(m): dict(c) for m, c in saved.get("modules", {}).items()}
        self._agent_steps_added = int(saved.get("agent_steps_added", 0))
        for agent, aid in saved.get("agents", []):
            self._ma_writer.agents[agent] = aid
            self._ma_writer.order.setdefault(agent, len(self._ma_writer.order))


def _of_module(source: Mapping[str, Any], name: str, i: int) -> dict[str, Any]:
    """``source`` (renamed ``name``) drawing only the records of the ``i``-th module of the
    recipe (its param ``rllib_module_<i>``), its own ``where`` kept."""
    mine = f"tags.{MODULE_TAG} == ${MODULE_TAG}_{i}"
    where = source.get("where")
    if where is None:
        combined: Any = mine
    elif isinstance(where, str):
        combined = f"({where}) and {mine}"
    else:
        combined = {**where, f"tags.{MODULE_TAG}": f"${MODULE_TAG}_{i}"}
    return {**source, "name": name, "where": combined}

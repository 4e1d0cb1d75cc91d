"""``RecordParallelSteps``: records a PettingZoo parallel env's steps into Claw, one record
per agent and env step, tied into joint steps (:mod:`claw_tasks.format.joint`).

AEC envs whose agents all act once per cycle go through PettingZoo's own conversion,
``RecordParallelSteps(aec_to_parallel(env), ingestor)``; turn-based games (one agent acts
per turn) are recorded the same way, as joint steps of one present agent each, when the
parallel wrapper accepts them, or with one ``ingestor.episode(..., agent_id=a)`` per agent
(per-agent views only). Import it from ``claw_tasks.client.pettingzoo``: pettingzoo is
loaded only then.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from pettingzoo.utils.env import ParallelEnv

from claw_tasks.client.episode import Episode
from claw_tasks.client.ingestor import Ingestor
from claw_tasks.format.joint import AGENTS_TAG, EPISODE_TAG, STATE_FIELD, agent_episode, joint_code

__all__ = ["RecordParallelSteps"]

StateTags = Callable[[np.ndarray], Mapping[str, float | str]]
"""Scalar features of the global state, stored as tags of the joint step's anchor (so a
joint recipe filters on them: ``tags.<name>``)."""


class RecordParallelSteps:
    """Wraps a PettingZoo ``ParallelEnv``: ``reset`` and ``step`` as the env's, and every
    acting agent's step is recorded through ``ingestor``; the user's loop stays unchanged.

    - Each agent's steps of an env episode are one Claw episode (``agent_id`` the agent),
      ``step_index`` the env step ``t``, ``tags.joint_episode`` the env episode: the
      records of one env step share the joint key (episode, ``t``).
    - The global state ``env.state()`` (``state=True``, the default when the env has one)
      is stored once per joint step, in the ``state`` field of its anchor (the first agent
      present in ``possible_agents`` order), which also gets ``tags.joint_agents`` (the
      agents present) and ``state_tags(state)``. The last joint step's anchor holds the
      state after it too.
    - Agents that die leave the env's ``agents`` (their last step is terminated or
      truncated, with their final observation as ``next_obs`` when the env returns one);
      agents that join start their own episode at the step they first act: absence is
      data, not an error.
    - ``policy_version`` (settable) is recorded on the episodes reset from then on; other
      keywords are tags on every record.
    """

    def __init__(
        self,
        env: ParallelEnv,
        ingestor: Ingestor,
        *,
        task_id: str | None = None,
        state: bool | None = None,
        state_tags: StateTags | None = None,
        record_info: bool = False,
        policy_version: int | None = None,
        **tags: Any,
    ) -> None:
        self.env, self.ingestor = env, ingestor
        self.order = {a: i for i, a in enumerate(env.possible_agents)}
        self.state = _has_state(env) if state is None else state
        self.state_tags = state_tags
        self.record_info = record_info
        self.policy_version = policy_version
        self._meta: dict[str, Any] = {"task_id": task_id, "origin": "online", **tags}
        if self.state and STATE_FIELD not in ingestor.ragged:  # (k, *shape): k = 0, 1 or 2
            ingestor.ragged = (*ingestor.ragged, STATE_FIELD)
        self._episodes: dict[str, Episode] = {}
        self._obs: dict[str, Any] = {}
        self._id = ""
        self._code = 0.0
        self._t = 0
        self._s: np.ndarray | None = None

    @property
    def episode_id(self) -> str:
        """The env episode being recorded (its agents' episodes are
        ``<episode_id>/<agent>``); empty before ``reset`` and after the episode ended."""
        return self._id

    @property
    def step_index(self) -> int:
        """The next joint step's ``t``."""
        return self._t

    def __getattr__(self, name: str) -> Any:  # the env's other attributes (agents, spaces)
        return getattr(self.env, name)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        obs, infos = self.env.reset(seed=seed, options=options)
        self._id = uuid.uuid4().hex
        self._code = joint_code(self._id)
        self._episodes, self._obs, self._t = {}, dict(obs), 0
        self._s = self._global_state()
        return obs, infos

    def step(self, actions: Mapping[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        if not self._id:
            raise RuntimeError("call reset() before step()")
        unknown = [a for a in actions if a not in self._obs]
        if unknown:
            raise ValueError(f"actions for agents not in the env: {unknown}")
        obs, rewards, terms, truncs, infos = self.env.step(actions)
        acting = sorted(actions, key=self.order.__getitem__)
        after = self._global_state()
        last = not self.env.agents
        for i, a in enumerate(acting):
            ended = bool(terms.get(a, False) or truncs.get(a, False)) or a not in obs
            fields: dict[str, Any] = {}
            if self.state:
                assert self._s is not None
                fields[STATE_FIELD] = self._state_rows(i == 0, last, after)
            step_tags: dict[str, Any] = {}
            if i == 0:  # the anchor
                step_tags[AGENTS_TAG] = float(len(acting))
                if self.state_tags is not None and self._s is not None:
                    step_tags.update(self.state_tags(self._s))
            ep = self._episode(a)
            ep.step_index = self._t  # the env's step counter: the joint key
            ep.add(
                self._obs[a],
                np.asarray(actions[a]),
                float(rewards.get(a, 0.0)),
                next_obs=obs.get(a) if ended else None,
                terminated=bool(terms.get(a, False)),
                truncated=bool(truncs.get(a, False)),
                info=self._info(infos.get(a)),
                **fields,
                **step_tags,
            )
            if ended:
                self._episodes.pop(a).end()
        self._obs = {a: o for a, o in obs.items() if a in self.env.agents}
        self._t += 1
        self._s = after
        if last:
            self._id = ""
        return obs, rewards, terms, truncs, infos

    def close(self) -> None:
        self.ingestor.flush(wait=False)
        self.env.close()

    def _episode(self, agent: str) -> Episode:
        ep = self._episodes.get(agent)
        if ep is None:
            tags: dict[str, Any] = {EPISODE_TAG: self._code, **self._meta}
            ep = self._episodes[agent] = self.ingestor.episode(
                agent_episode(self._id, agent),
                agent_id=agent,
                policy_version=self.policy_version,
                **tags,
            )
        return ep

    def _global_state(self) -> np.ndarray | None:
        return np.asarray(self.env.state()) if self.state else None

    def _state_rows(self, anchor: bool, last: bool, after: np.ndarray | None) -> np.ndarray:
        """The ``state`` row of a record: the state (and the state after the episode's last
        step) on the anchor, no items elsewhere."""
        s = self._s
        assert s is not None
        if not anchor:
            return np.zeros((0, *s.shape), s.dtype)
        if last and after is not None:
            return np.stack([s, after.astype(s.dtype, copy=False)])
        return s[None]

    def _info(self, info: Mapping[str, Any] | None) -> dict[str, Any] | None:
        if not self.record_info or not info:
            return None
        return {
            k: v.item() if isinstance(v, np.generic) else v
            for k, v in info.items()
            if isinstance(v, str | int | float | bool | np.generic)
        }


def _has_state(env: ParallelEnv) -> bool:
    try:
        env.state()
    except NotImplementedError:
        return False
    except Exception:  # e.g. not reset yet: try again once reset
        return True
    return True

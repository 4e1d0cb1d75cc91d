"""Joint time steps of multi-agent data, as stored: every agent's step is its own record,
and these names tie the records of one env step together (docs/recipes.md, "Joint
batches"). The recorder (:mod:`claw_tasks.client.pettingzoo`) writes them; the joint
recipes (:mod:`orchestrator.sampling.joint`) read them.

- Each agent's steps of one env episode are a Claw episode of their own
  (:func:`agent_episode`), so per-agent views, ``next_obs`` and n-step work as for any
  episode; ``step_index`` is the env's step counter ``t``, the same for every agent.
- ``tags.joint_episode`` (:data:`EPISODE_TAG`) on every record: the env episode, hashed
  (:func:`joint_code`). A joint step is the records with equal ``(joint_episode,
  step_index)``: its *joint key*.
- One record per joint step is its *anchor*: the first agent present, in the env's
  ``possible_agents`` order. Only the anchor has ``tags.joint_agents``
  (:data:`AGENTS_TAG`): how many agents were present, so a joint step missing a record
  (evicted) is seen as partial. The anchor alone holds the global state, in the ragged
  field ``state`` (:data:`STATE_FIELD`): one item, ``env.state()``, or two on the
  episode's last joint step (the state after it, as an explicit ``next_obs`` is kept);
  the other records' rows are empty, and an empty ragged row is not stored.
"""

from __future__ import annotations

from claw_tasks.format.turns import prompt_key

EPISODE_TAG = "joint_episode"
"""Numeric tag on every agent record: :func:`joint_code` of the env episode."""

AGENTS_TAG = "joint_agents"
"""Numeric tag on a joint step's anchor only: the number of agents present at it."""

STATE_FIELD = "state"
"""Ragged payload field of the global state: ``(k, *state_shape)``, k = 1 on the anchor
(2 on an episode's last joint step: the state, then the state after it), 0 elsewhere."""


def joint_code(episode_id: str) -> float:
    """``tags.joint_episode`` of an env episode id: a 53-bit hash, exact in float64 (a
    number column grows no string dictionary; collisions are negligible below ~10^7
    episodes)."""
    return prompt_key(episode_id)


def agent_episode(episode_id: str, agent: str) -> str:
    """The Claw episode id of ``agent``'s steps in env episode ``episode_id``."""
    return f"{episode_id}/{agent}"

"""``Episode``: one episode's steps, added in order, checked and buffered by its Ingestor
(``Ingestor.episode`` makes one; it knows only the two callables it is given)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from claw_tasks.client.checks import Step, check_int32
from claw_tasks.format.schema import BOOTSTRAP_VALUE, VALUE, SchemaError

CheckStep = Callable[..., Step]
"""Checks one step against the schema and builds it, raising on bad input: called as
``check(episode_id, step_index, fields, reward, next_obs, info, meta, tags, priority,
terminated, truncated)``."""


class Episode:
    """Steps of one episode, added in order. Use as a context manager: leaving the block
    ends the episode (:meth:`end`). ``check`` builds a step (:data:`CheckStep`),
    ``buffer`` takes it (and may send the buffer); ``meta`` (``task_id``, ``agent_id``,
    ``skill_tag``, ``reward_source``, ``policy_version``) and ``tags`` go on every step."""

    def __init__(
        self,
        check: CheckStep,
        buffer: Callable[[Step], None],
        episode_id: str,
        meta: dict[str, Any],
        tags: dict[str, Any],
    ):
        self.check = check
        self.buffer = buffer
        self.episode_id = episode_id
        self.meta = meta
        self.tags = tags
        self.step_index = 0
        self.ended = False

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        """End the episode: a later :meth:`add` raises. Its steps go out with the
        Ingestor's next batch (by count, by ``flush_interval``, or ``flush``/``close``):
        batches span episodes, so ending one sends nothing by itself. The last step's
        ``terminated``/``truncated`` are the ones it was added with; nothing is marked."""
        self.ended = True

    def add(
        self,
        obs: Any,
        action: Any,
        reward: float,
        next_obs: Any = None,
        terminated: bool = False,
        truncated: bool = False,
        info: Mapping[str, Any] | None = None,
        skill_tag: str | None = None,
        priority: float | None = None,
        policy_version: int | None = None,
        **fields_and_tags: Any,
    ) -> None:
        """Add the next step. Extra keyword arrays are payload fields (e.g. ``prompt_ids``);
        extra scalars (str/int/float) are tags. ``policy_version`` overrides the episode's
        for this step (an actor that loads new weights mid-episode: on-policy segments).
        On-policy steps carry the tags ``log_prob``, ``value`` and, on a segment's last
        step or a truncated one, ``bootstrap_value`` = V(next_obs) (``Schema.rollout``):
        a truncated step with a ``value`` and no ``bootstrap_value`` is refused, since
        nothing after it could say what it bootstraps with. Raises before buffering on
        bad input."""
        if self.ended:
            raise RuntimeError(
                f"episode {self.episode_id!r} has ended (its with block exited, or end() was "
                "called); start the next one with ingestor.episode()"
            )
        fields = {"obs": obs, "action": action}
        tags = dict(self.tags)
        for k, v in fields_and_tags.items():
            if isinstance(v, str | int | float | bool | np.generic):  # a scalar: a tag
                tags[k] = v
            else:
                fields[k] = v
        meta = self.meta if skill_tag is None else {**self.meta, "skill_tag": skill_tag}
        if policy_version is not None:
            check_int32(
                policy_version,
                f"step {self.step_index} of episode {self.episode_id!r}: policy_version",
            )
            meta = {**meta, "policy_version": int(policy_version)}
        if truncated and not terminated and VALUE in tags and BOOTSTRAP_VALUE not in tags:
            raise SchemaError(
                f"step {self.step_index} of episode {self.episode_id!r}: truncated with a "
                f"{VALUE!r} but no {BOOTSTRAP_VALUE!r}: a truncated on-policy step bootstraps "
                f"with V(next_obs); pass {BOOTSTRAP_VALUE}=<that value>"
            )
        step = self.check(
            self.episode_id,
            self.step_index,
            fields,
            reward,
            next_obs,
            info,
            meta,
            tags,
            priority,
            terminated,
            truncated,
        )
        # Accepted: the step is buffered from here on, even if the send ``buffer`` may start
        # fails (it is kept and re-sent), so it has its index now.
        self.step_index += 1
        self.buffer(step)

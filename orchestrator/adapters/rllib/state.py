"""Checkpointing a Claw RLlib buffer (``get_state`` / ``set_state``): its settings and
counters, never its data nor a password.

The data stays in Redis under the buffer's namespace; URLs are saved without a password,
which comes from ``CLAW_REDIS_URL`` / ``CLAW_BROKER_URL`` again in ``set_state`` when they
name the same server, and ``set_state`` reconnects to the saved namespace."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from claw_tasks.settings import get_settings, redact_url
from orchestrator.adapters.urls import with_env_password, without_password
from orchestrator.adapters.versions import PolicyVersion

log = logging.getLogger(__name__)

STATE_FORMAT = 1
"""The layout of :meth:`ClawEpisodeReplayBuffer.get_state`'s ``"claw"`` entry."""


class SavedState:
    """``get_state`` / ``set_state`` of :class:`ClawEpisodeReplayBuffer` (and its
    subclasses): the constructor's arguments (``_init_kw``) and the counters."""

    _init_kw: dict[str, Any]
    _num_timesteps_added: int
    _num_episodes_added: int
    _samples: int
    sampled_timesteps: int
    namespace: str
    policy_version: PolicyVersion

    def get_state(self) -> dict[str, Any]:
        """Settings, namespace, recipe overrides, seed, counters and the lineage declaration
        (a counter's name; a callable is not saved); never the data nor a password (plain
        values: a checkpoint may pickle or msgpack them)."""
        self.flush()  # what was added is in the store first
        kw = dict(self._init_kw)
        kw["redis_url"] = without_password(kw["redis_url"])
        kw["broker_url"] = without_password(kw["broker_url"])
        declared = self.policy_version  # a callable is the caller's to set again
        kw["policy_version"] = declared if isinstance(declared, str) else None
        return {
            "claw": {
                "format": STATE_FORMAT,
                "class": type(self).__name__,
                "init": kw,
                "timesteps_added": self._num_timesteps_added,
                "sampled_timesteps": self.sampled_timesteps,
                "episodes_added": self._num_episodes_added,
                "samples": self._samples,
            }
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Reconnect to the namespace of a :meth:`get_state` (this buffer's current
        connection is flushed and closed first)."""
        saved = state.get("claw") if isinstance(state, Mapping) else None
        if not isinstance(saved, Mapping) or saved.get("format") != STATE_FORMAT:
            raise ValueError(
                f"{type(self).__name__}.set_state: not a Claw buffer's state (RLlib's own "
                "buffer saves its episodes; a Claw buffer saves settings and reads its data "
                "from the namespace)"
            )
        kw = dict(saved["init"])
        settings = get_settings()
        kw["redis_url"] = with_env_password(kw["redis_url"], settings.redis_url)
        kw["broker_url"] = with_env_password(kw["broker_url"], settings.broker_url)
        self.close()
        self.__init__(**kw)  # type: ignore[misc]  # re-initialised in place from the saved settings
        self._num_timesteps_added = int(saved["timesteps_added"])
        self.sampled_timesteps = int(saved["sampled_timesteps"])
        self._num_episodes_added = int(saved["episodes_added"])
        self._samples = int(saved["samples"])
        log.info(
            "%s: reconnected to namespace %r at %s",
            type(self).__name__,
            self.namespace,
            redact_url(kw["redis_url"] or settings.redis_url),
        )

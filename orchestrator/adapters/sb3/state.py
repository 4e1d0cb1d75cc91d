"""Pickling a Claw SB3 buffer (``save_replay_buffer``, ``deepcopy``): its settings, never
its data nor a password.

The data stays in Redis under the buffer's namespace (keep it); URLs are saved without a
password, which comes from ``CLAW_REDIS_URL`` / ``CLAW_BROKER_URL`` again on load when they
name the same server. Loading rebuilds the buffer and reconnects to the namespace
generation it was saved in.
"""

from __future__ import annotations

import logging
from typing import Any

from claw_tasks.settings import get_settings, redact_url
from orchestrator.adapters.urls import with_env_password, without_password

log = logging.getLogger(__name__)


class SavedState:
    """``__getstate__`` / ``__setstate__`` of :class:`ClawReplayBuffer` (and its Dict
    variant): the constructor's arguments (``_init_kw``) and the counters."""

    _init_kw: dict[str, Any]
    updates: int
    timesteps: int

    def __getstate__(self) -> dict[str, Any]:
        """Settings, namespace, recipe (overrides and seed) and counters; never the data nor
        a password (nor a callable ``policy_version``: set it again after loading)."""
        self.flush()  # type: ignore[attr-defined]  # what was added is in the store first
        kw = dict(self._init_kw)
        kw["redis_url"] = without_password(kw["redis_url"])
        kw["broker_url"] = without_password(kw["broker_url"])
        return {
            "init": kw,
            "generation": self.generation,
            "pos": self.pos,  # type: ignore[attr-defined]  # a mixin of SB3's buffers: they define pos
            "full": self.full,
            "samples": self._samples,
            "updates": self.updates,
            "timesteps": self.timesteps,
        }  # type: ignore[attr-defined]  # a mixin of SB3's buffers: they define pos

    def __setstate__(self, state: dict[str, Any]) -> None:
        kw = dict(state["init"])
        settings = get_settings()
        kw["redis_url"] = with_env_password(kw["redis_url"], settings.redis_url)
        kw["broker_url"] = with_env_password(kw["broker_url"], settings.broker_url)
        generation = state["generation"]
        self.__init__(**kw)  # type: ignore[misc]  # own recipe names: see __init__
        buf: Any = self
        if generation:  # reconnect to the generation the buffer was saved in
            buf._finalizer()
            buf.generation = generation
            buf._connect()
        buf.pos, buf.full, buf._samples = state["pos"], state["full"], state["samples"]
        buf.updates, buf.timesteps = state.get("updates", 0), state.get("timesteps", 0)
        log.info(
            "%s: reconnected to namespace %r at %s",
            type(self).__name__,
            buf.namespace,
            redact_url(kw["redis_url"] or settings.redis_url),
        )

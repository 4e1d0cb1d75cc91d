"""Transitions of parallel streams, written as Claw episodes.

A replay buffer is given ``(obs, action, reward, next_obs, done)`` rows of parallel
streams (SB3's envs, TorchRL's trajectories). A transition is written when its stream's
next one arrives: if its ``next_obs`` is that transition's ``obs`` (always, in a rollout
loop) it is stored once, as Claw does; otherwise, and at episode ends, it is stored
explicitly.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.client import Episode, Ingestor
from claw_tasks.client.columns import StepColumns


@dataclass
class _Stream:
    """A stream's current episode: its id and the index of its next step."""

    episode_id: str
    step: int = 0


@dataclass
class _Pending:
    """A stream's newest transition, held until its successor shows how to store next_obs."""

    episode: _Stream
    obs: np.ndarray
    action: np.ndarray
    reward: float
    next_obs: np.ndarray
    priority: float | None


class Transitions:
    """Transitions of parallel streams, each a run of Claw episodes (a new one after each
    end). ``episode`` holds keyword arguments of :meth:`Ingestor.episode` (and of
    :meth:`Ingestor.columns`, through which the steps are written once the schema is
    known: a copy into preallocated columns, sent by the Ingestor's thread)."""

    def __init__(self, ingestor: Ingestor, episode: Mapping[str, Any] | None = None) -> None:
        self.ingestor = ingestor
        self.episode_kw = dict(episode or {})
        self._streams: dict[Hashable, _Stream] = {}
        self._pending: dict[Hashable, _Pending] = {}
        self._columns: StepColumns | None = None
        self._episodes: dict[str, Episode] = {}  # without columns (no schema yet: inferred)

    def add(
        self,
        stream: Hashable,
        obs: np.ndarray,
        action: np.ndarray,
        reward: float,
        next_obs: np.ndarray,
        *,
        terminated: bool = False,
        truncated: bool = False,
        priority: float | None = None,
    ) -> None:
        """The next transition of ``stream``; ``terminated`` or ``truncated`` ends its
        episode (next_obs stored explicitly; a timeout bootstraps)."""
        self.release(stream, obs)
        episode = self._streams.get(stream)
        if episode is None:
            episode = self._streams[stream] = _Stream(self.ingestor.new_episode_id())
        if not (terminated or truncated):
            self._pending[stream] = _Pending(episode, obs, action, reward, next_obs, priority)
            return
        self._write(episode, obs, action, reward, next_obs, terminated, truncated, priority)
        del self._streams[stream]
        self._episodes.pop(episode.episode_id, None)

    def release(self, stream: Hashable, obs: np.ndarray) -> None:
        """Write ``stream``'s held transition, ``obs`` being its successor's (``add`` does
        it first). A caller adding a time step of several streams releases them all before
        adding: steps are then stored, and the ring evicts them, time step by time step.
        The held next_obs is stored once (as the successor's obs) only when the two are
        the same bytes."""
        held = self._pending.pop(stream, None)
        if held is not None:
            nxt = held.next_obs
            same = nxt.shape == obs.shape and nxt.dtype == obs.dtype
            explicit = not (same and nxt.tobytes() == obs.tobytes())
            self._write_held(held, explicit)

    def write_pending(self) -> None:
        """Write each stream's held transition with its next_obs (before a flush: a held
        one would otherwise wait for a successor that may never come)."""
        for held in self._pending.values():
            self._write_held(held, True)
        self._pending.clear()

    def _write_held(self, held: _Pending, explicit_next: bool) -> None:
        nxt = held.next_obs if explicit_next else None
        h = held
        self._write(h.episode, h.obs, h.action, h.reward, nxt, False, False, h.priority)

    def _write(
        self,
        episode: _Stream,
        obs: np.ndarray,
        action: np.ndarray,
        reward: float,
        next_obs: np.ndarray | None,
        terminated: bool,
        truncated: bool,
        priority: float | None,
    ) -> None:
        columns = self._columns
        if columns is None and self.ingestor.schema is not None:
            columns = self._columns = self.ingestor.columns(**self.episode_kw)
        if columns is not None:
            columns.append(
                episode.episode_id,
                episode.step,
                obs,
                action,
                reward,
                terminated=terminated,
                truncated=truncated,
                next_obs=next_obs,
                priority=priority,
            )
        else:  # the first step: its Episode infers the schema
            writer = self._episodes.get(episode.episode_id)
            if writer is None:
                writer = self.ingestor.episode(episode.episode_id, **self.episode_kw)
                writer.step_index = episode.step
                self._episodes[episode.episode_id] = writer
            writer.add(
                obs,
                action,
                reward,
                next_obs=next_obs,
                terminated=terminated,
                truncated=truncated,
                priority=priority,
            )
        episode.step += 1

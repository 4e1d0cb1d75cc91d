"""What every replay-buffer adapter (SB3, TorchRL, RLlib) holds open on a Claw namespace.

- :class:`Transitions` turns ``(obs, action, reward, next_obs, done)`` rows of parallel
  streams (SB3's envs, TorchRL's trajectories) into Claw episodes. A transition is written
  when its stream's next one arrives: if its ``next_obs`` is that transition's ``obs``
  (always, in a rollout loop) it is stored once, as Claw does; otherwise, and at episode
  ends, it is stored explicitly.
- :class:`Connection` holds the :class:`Ingestor`, the :class:`BatchClient`, the recipes
  this buffer registered (one per batch size and sampler) with their read-aheads,
  and closes all of it once (``close``, a reset, garbage collection or exit). A recipe may
  be registered ``parts`` times larger than what the trainer asks for: each popped batch
  then serves ``parts`` samples (see :func:`split`), so the workers and the read-ahead
  pay their per-batch costs (a task, a Redis round trip, a decode) once per
  ``parts`` samples — in a burst of gradient steps those costs, not the rows, are what
  the trainer waits for.
- :mod:`orchestrator.adapters.cadence` sizes those reads from the trainer's bursts.
- :class:`Versions`: the policy (update) version each served sample trains, as the
  adapter counts it or the trainer declares it, recorded in the lineage log with the ids
  of that sample (:meth:`Connection.pop`), so ``claw lineage NS --policy v`` answers for
  drop-in users too.
- :func:`without_password` / :func:`with_env_password`: what a saved buffer keeps of its
  URLs (never a password: it comes from the environment again on load);
  :func:`global_seed`: a buffer's seed when none is given, from the seed the trainer set.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from claw_tasks.client import Episode, Ingestor
from claw_tasks.client.columns import StepColumns
from claw_tasks.settings import get_settings
from orchestrator.adapters.cadence import Plan
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import Served
from orchestrator.delivery.readahead import ReadAhead
from orchestrator.delivery.readahead_process import ProcessReadAhead, ReadAheadProcessError
from orchestrator.sampling.batch import Batch

PolicyVersion = str | Callable[[int], Any] | None
"""How an adapter declares what each sample trains: the name of one of its counters (e.g.
``"updates"``), a callable given the sample's number (1, 2, ...) returning the version
(``None``: not recorded), or None (nothing recorded)."""

log = logging.getLogger(__name__)


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


class Versions:
    """The policy version each sample an adapter serves trains (see ``PolicyVersion``).

    ``counters`` names what the adapter counts (e.g. ``updates``: its ``sample()`` calls;
    ``timesteps``: transitions added), each read when a sample is served; ``declare``
    picks one, or is a callable of the sample's number, or None."""

    def __init__(self, declare: PolicyVersion, counters: Mapping[str, Callable[[], int]]) -> None:
        if isinstance(declare, str) and declare not in counters:
            raise ValueError(
                f"policy_version={declare!r}: one of {', '.join(map(repr, counters))}, a "
                "callable of the sample's number, or None"
            )
        if declare is not None and not isinstance(declare, str) and not callable(declare):
            raise TypeError(
                f"policy_version: a counter's name, a callable or None, not {declare!r}"
            )
        self.declare, self.counters = declare, counters

    def of(self, number: int) -> Any:
        """The version sample ``number`` (1, 2, ... as the adapter counts its samples)
        trains; None: not recorded."""
        if self.declare is None:
            return None
        if isinstance(self.declare, str):
            return self.counters[self.declare]()
        return self.declare(number)


@dataclass(eq=False)
class Connection:
    """What a buffer holds open on one namespace; closed once."""

    ingestor: Ingestor
    client: BatchClient
    transitions: Transitions
    names: dict[Hashable, str] = field(default_factory=dict)  # key -> registered recipe
    readaheads: dict[str, ReadAhead | ProcessReadAhead] = field(default_factory=dict)
    _prepare: dict[str, Callable[[Batch], list[tuple[Served, Any]]]] = field(default_factory=dict)
    _left: dict[str, deque[Any]] = field(default_factory=dict)  # parts not served yet
    replans: int = 0  # recipes dropped by resize(): recipe names made after one carry it
    _parts: dict[str, int] = field(default_factory=dict)
    _spares: list[ProcessReadAhead] = field(default_factory=list)  # of dropped recipes

    def recipe(
        self,
        key: Hashable,
        spec: Mapping[str, Any],
        readahead: int,
        readahead_bytes: int,
        parts: int = 1,
        convert: Callable[[Batch], Any] | None = None,
        convert_parts: Callable[[Batch, int], list[Any]] | None = None,
    ) -> str:
        """The recipe serving ``key`` (e.g. a batch size), registered from ``spec`` on first
        use after a flush (everything added so far can be drawn), with ``readahead``
        batches decoded ahead in this process (0: none). Each of its batches serves
        ``parts`` pops (``spec``'s batch size is ``parts`` times a pop's), each part
        passed through ``convert`` — in the read-ahead thread when there is one.
        ``convert_parts`` instead converts a whole batch at once, given it with each part's
        rows contiguous (:func:`interleaved`) and the number of parts, and returns the
        parts' items in order: one conversion per batch rather than per part."""
        name = self.names.get(key)
        if name is None:
            self.flush()
            name = self.names[key] = self.client.register(spec).name

            def prepare(batch: Batch) -> list[tuple[Served, Any]]:
                if convert_parts is not None and parts > 1 and len(batch) % parts == 0:
                    # one source: its rows are independent draws, so contiguous parts are
                    # as good as strided ones, and need no gather
                    whole = batch if len(batch.sources) <= 1 else interleaved(batch, parts)
                    ids = whole.ids.reshape(parts, -1)  # a fresh array: no copy needed
                    items = convert_parts(whole, parts)
                    version = whole.recipe_version
                    return [(Served(version, i), it) for i, it in zip(ids, items, strict=True)]
                got = split(batch, parts) if parts > 1 else [batch]
                return [
                    (Served(b.recipe_version, b.ids.copy()), b if convert is None else convert(b))
                    for b in got
                ]

            self._prepare[name] = prepare
            self._parts[name] = parts
            if readahead and get_settings().readahead_process:
                self.readaheads[name] = self._process_readahead(
                    name, readahead, readahead_bytes, prepare
                )
            elif readahead:
                self.readaheads[name] = ReadAhead(
                    self.client,
                    name,
                    count=readahead,
                    max_bytes=readahead_bytes,
                    convert=prepare,
                )
        return name

    def _process_readahead(
        self, name: str, count: int, max_bytes: int, convert: Callable[[Batch], Any]
    ) -> ProcessReadAhead:
        """A read-ahead process for recipe ``name``: a spare's (a re-plan's new recipe is
        read by the same child) while one is alive, else a new one."""
        while self._spares:
            spare = self._spares.pop()
            if spare.alive:
                try:
                    spare.retarget(name, count, convert, max_bytes)
                except ReadAheadProcessError:
                    spare.close()
                    continue
                return spare
            spare.close()
        return ProcessReadAhead(
            self.client, name, count=count, max_bytes=max_bytes, convert=convert
        )

    def start_readahead(self, plan: Plan) -> None:
        """Start a read-ahead process now if ``plan`` reads ahead, for its first recipe:
        its ~1 s of imports then overlap the trainer's warm-up (SB3's ``learning_starts``)
        instead of its first ``sample()``."""
        if plan.readahead and get_settings().readahead_process and not self._spares:
            self._spares.append(ProcessReadAhead(self.client, None))

    def pop(self, name: str, timeout: float | None, policy_version: Any = None) -> Any:
        """The next part (converted) of recipe ``name``'s batches: from the read-ahead when
        it has one. ``policy_version`` (not None): recorded in the lineage log as what this
        part's rows train, sent with the next pop of whichever client pops (the read-ahead
        thread's, off the trainer's path)."""
        left = self._left.get(name)
        ra = self.readaheads.get(name)
        if not left:
            parts = (
                ra.pop(timeout)
                if ra is not None
                else self._prepare[name](self.client.pop(name, timeout))
            )
            left = self._left[name] = deque(parts)
        served, item = left.popleft()
        if policy_version is not None:
            if ra is not None:
                ra.trained(served, policy_version)
            else:
                self.client.trained(name, served, policy_version)
        return item

    def resize(self, plan: Plan) -> None:
        """Apply a new :class:`Plan`: read-aheads of recipes whose ``parts`` stay take the
        new count at once; a recipe of other ``parts`` (another batch size) is unregistered
        and its read-ahead stopped, and the next :meth:`recipe` registers it again under a
        new name (parts popped and not yet served are dropped; their rows stay in the
        store)."""
        stale = [k for k, name in self.names.items() if self._parts[name] != plan.parts]
        for key in stale:
            name = self.names.pop(key)
            ra = self.readaheads.pop(name, None)
            if isinstance(ra, ProcessReadAhead) and ra.alive:
                try:  # idle, with what it held for the recipe written before it goes
                    ra.park()
                    self._spares.append(ra)  # its child serves the next recipe made
                except (ReadAheadProcessError, TimeoutError):
                    ra.close()
            elif ra is not None:
                ra.close()
            self.client.unregister(name)
            for d in (self._prepare, self._left, self._parts):
                d.pop(name, None)
        self.replans += bool(stale)
        for ra in self.readaheads.values():
            ra.resize(plan.readahead)

    def flush(self, timeout: float = 60.0) -> None:
        """Write every transition added so far and wait until the store committed them."""
        self.transitions.write_pending()
        self.ingestor.flush(wait=True, timeout=timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Write what is pending, unregister this buffer's recipes, release connections."""
        try:
            self.transitions.write_pending()
            self.ingestor.close(timeout=timeout)
        finally:
            for ra in [*self.readaheads.values(), *self._spares]:
                ra.close()
            for name in self.names.values():
                self.client.unregister(name)
            self.client.close()


def split(batch: Batch, parts: int) -> list[Batch]:
    """``batch`` as ``parts`` batches of rows ``j::parts`` (views, no copy). Strided, not
    contiguous: a recipe lays its sources' rows out one source after another, so each part
    keeps the mix of sources. Rows are independent draws, so each part is a batch of the
    same recipe; importance weights stay normalized over the whole batch."""
    return [batch.take(slice(j, None, parts)) for j in range(parts)]


def interleaved(batch: Batch, parts: int) -> Batch:
    """``batch`` with the rows of :func:`split`'s part ``j`` (``j::parts``) at
    ``j*m:(j+1)*m``, ``m = len(batch) // parts``: one gather into fresh arrays, so a
    conversion of the whole batch cuts into the parts by contiguous views."""
    return batch.take(np.arange(len(batch)).reshape(-1, parts).T.ravel())


def ingest_options(ingest: Mapping[str, Any], capacity: int) -> dict[str, Any]:
    """Ingestor options for a buffer of ``capacity`` rows: ``ingest`` over the adapters'
    defaults, never flushing more than half the ring at once (a commit of more steps than
    the ring holds keeps none of them)."""
    options = {"flush_steps": 256, "flush_interval": 0.25, **ingest}
    options["flush_steps"] = min(options["flush_steps"], max(1, capacity // 2))
    return options


def close_quietly(conn: Connection) -> None:
    """The garbage-collection / exit path: bounded, and never raising at interpreter exit."""
    try:
        conn.close(timeout=10.0)
    except Exception as e:
        log.warning(
            "closing a Claw replay buffer of namespace %r: %s: %s (steps not yet "
            "committed may be lost; call close() to see it fail)",
            conn.ingestor.namespace,
            type(e).__name__,
            e,
        )


def generation_namespace(base: str, generation: int) -> str:
    """The namespace of a buffer's ``generation``-th reset: ``<base>.r<generation>`` (the
    first is ``base`` itself), so a reset starts empty without deleting the old data."""
    return base if not generation else f"{base}.r{generation}"


def global_seed() -> int:
    """A seed from numpy's global state without drawing from it: SB3 and RLlib seed that
    state before they build their buffer, so the algorithm's seed decides this one."""
    state = np.random.get_state()
    digest = hashlib.blake2b(state[1].tobytes() + int(state[2]).to_bytes(4), digest_size=4)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


def without_password(url: str | None) -> str | None:
    """``url`` with its password removed (what a saved buffer may keep)."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = (parts.username or "") + "@" + parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=netloc if parts.username else netloc[1:]))


def with_env_password(url: str | None, env_url: str) -> str | None:
    """A saved ``url`` again, with the environment's password when it names the same
    server (the password never travels in a saved buffer)."""
    if url is None or without_password(env_url) != url:
        return url
    return env_url

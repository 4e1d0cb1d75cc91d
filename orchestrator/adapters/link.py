"""What a replay-buffer adapter (SB3, TorchRL, RLlib) holds open on a Claw namespace.

A :class:`BufferLink` holds the :class:`Ingestor`, the :class:`BatchClient`, the recipes
this buffer registered (one per batch size and sampler) with their read-aheads, and closes
all of it once (``close``, a reset, garbage collection or exit). A recipe may be
registered ``parts`` times larger than what the trainer asks for: each popped batch then
serves ``parts`` samples (see :func:`~orchestrator.adapters.parts.split`), so the workers
and the read-ahead pay their per-batch costs (a task, a Redis round trip, a decode) once
per ``parts`` samples — in a burst of gradient steps those costs, not the rows, are what
the trainer waits for. :mod:`orchestrator.adapters.cadence` sizes those reads from the
trainer's bursts.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.client import Ingestor
from claw_tasks.settings import get_settings
from orchestrator.adapters.cadence import Plan
from orchestrator.adapters.parts import split
from orchestrator.adapters.transitions import Transitions
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import Served
from orchestrator.delivery.readahead import ReadAhead
from orchestrator.delivery.readahead_process import ProcessReadAhead, ReadAheadProcessError
from orchestrator.sampling.batch import Batch

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BufferLink:
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
        rows contiguous (the recipe's ``layout.parts``) and the number of parts, and returns the
        parts' items in order: one conversion per batch rather than per part."""
        name = self.names.get(key)
        if name is None:
            self.flush()
            laid_out = parts > 1 and len(spec.get("sources") or ()) > 1
            if laid_out:  # the workers put each part's rows together, keeping the mix
                spec = {**spec, "layout": {**(spec.get("layout") or {}), "parts": parts}}
            name = self.names[key] = self.client.register(spec).name

            process = bool(readahead) and get_settings().readahead_process
            # The lineage entry of a part is encoded when it is declared in a read-ahead
            # process's trainer (views will do), later on the other paths: copied, so it
            # keeps no view of the delivered buffer (a shared-memory segment stays taken
            # while one lives)
            own = np.asarray if process else np.array

            def prepare(batch: Batch) -> list[tuple[Served, Any]]:
                if convert_parts is not None and parts > 1 and len(batch) % parts == 0:
                    # each part's rows are contiguous: one source's rows are independent
                    # draws (contiguous parts are as good as strided ones); several
                    # sources' rows the workers laid out by parts
                    ids = own(batch.ids).reshape(parts, -1)
                    weights = own(batch.weights).reshape(parts, -1)
                    sources = own(batch.source_index).reshape(parts, -1)
                    items = convert_parts(batch, parts)
                    version, digest = batch.recipe_version, batch.recipe_digest
                    return [
                        (Served(version, i, w, None, digest, s), it)
                        for i, w, s, it in zip(ids, weights, sources, items, strict=True)
                    ]
                got = split(batch, parts, contiguous=laid_out) if parts > 1 else [batch]
                return [(served(b, own), b if convert is None else convert(b)) for b in got]

            self._prepare[name] = prepare
            self._parts[name] = parts
            if process:
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


def served(batch: Batch, own: Callable[[Any], np.ndarray] = np.array) -> Served:
    """What the lineage records of a batch (or a part of one) an adapter serves: its ids,
    weights and sources (``own`` of them: copied off the popped batch by default), its
    recipe version's digest and, for a whole batch, its augmentation seed (a part has
    none: ``Batch.take``)."""
    return Served(
        batch.recipe_version,
        own(batch.ids),
        own(batch.weights),
        batch.seed,
        batch.recipe_digest,
        own(batch.source_index),
    )


def close_quietly(link: BufferLink) -> None:
    """The garbage-collection / exit path: bounded, and never raising at interpreter exit."""
    try:
        link.close(timeout=10.0)
    except Exception as e:
        log.warning(
            "closing a Claw replay buffer of namespace %r: %s: %s (steps not yet "
            "committed may be lost; call close() to see it fail)",
            link.ingestor.namespace,
            type(e).__name__,
            e,
        )

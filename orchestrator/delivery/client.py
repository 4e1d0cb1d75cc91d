"""``BatchClient``: the trainer's side. Register recipes, pop ready batches.

What its pops report is held in :mod:`~orchestrator.delivery.popreports`, what a dropped
batch gives back is :mod:`~orchestrator.delivery.giveback`, its ``stats`` and a timeout's
explanation are :mod:`~orchestrator.delivery.recipestats`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from claw_tasks.broker.app import client_app
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.delivery import admission, giveback, shm
from orchestrator.delivery.lineage import LineageLog, Traced
from orchestrator.delivery.popreports import PopReports
from orchestrator.delivery.priorities import PriorityWriter
from orchestrator.delivery.readahead import ReadAhead
from orchestrator.delivery.recipestats import prefetch_consumers, recipe_stats, why_empty
from orchestrator.delivery.registry import Entry, Registry
from orchestrator.delivery.wire import WireVersionError
from orchestrator.recipe.model import Recipe, RecipeLike, as_recipe, same_recipe
from orchestrator.retrieval import Neighbours, nearest
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.groups import Claim

__all__ = ["BatchClient"]

log = logging.getLogger(__name__)

_FLUSH = object()  # asks the sending thread to send the lineage recorded by local pops


class BatchClient:
    """Pops prefetched, augmented batches of registered recipes from Redis queues.

    Workers on the ``prefetch`` queue fill each recipe's bounded queue; a pop that leaves
    the queue under its low-water mark asks for a refill (one at a time per recipe), and a
    beat task tops up every queue each second as a safety net.

    ``readahead`` (default ``CLAW_READAHEAD``, 0: off): batches of each recipe a
    background thread keeps popped and decoded in this process (at most
    ``readahead_bytes`` of them), so :meth:`pop` is a local dequeue while they last
    (:class:`~orchestrator.delivery.readahead.ReadAhead`; not for ``rollout`` nor
    ``admission`` recipes, whose batches follow the policy versions). Batches then leave
    the Redis queue before the trainer takes them (``depth`` counts them no longer;
    ``popped`` counts them when the thread takes them).
    """

    def __init__(
        self,
        namespace: str | None = None,
        redis_url: str | None = None,
        *,
        broker_url: str | None = None,
        readahead: int | None = None,
        readahead_bytes: int = 64 << 20,
    ) -> None:
        settings = get_settings()
        self.readahead = settings.readahead if readahead is None else readahead
        self.readahead_bytes = readahead_bytes
        self._ahead: dict[str, ReadAhead] = {}
        self.namespace = namespace or settings.namespace
        self.redis_url, self.broker_url = redis_url, broker_url  # as given (None: environment)
        url = self._url = redis_url or settings.redis_url
        self.store = Store(url, self.namespace)
        self.registry = Registry(self.store)
        self.app = client_app(broker_url or settings.broker_for(redis_url))
        self.host = shm.host_id()
        self._recipes: dict[str, Recipe] = {}
        self.lineage = LineageLog(self.store)
        """The namespace's lineage log (:mod:`orchestrator.delivery.lineage`)."""
        self._reports = PopReports(self.registry, self.lineage)  # sent with the next pop
        self._priorities: PriorityWriter | None = None
        self._refills: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=self._send_refills, name="claw-refill-requests", daemon=True
        )
        self._sender.start()

    # ---- recipes -------------------------------------------------------------------
    def register(self, recipe: RecipeLike) -> Recipe:
        """Validate ``recipe`` against the namespace schema and start prefetching it.

        Registering an identical recipe again keeps its version and queued batches (and adds
        this host to its readers: trainers on several hosts get batches inline, not through
        ``/dev/shm``); a changed one gets the next ``version`` and its queued batches (of
        the old version) are dropped.
        """
        recipe = as_recipe(recipe)
        if self.store.exists() and (schema := self.store.schema()) is not None:
            recipe.validate_against(schema)
        if recipe.as_of is not None:
            self.store.snapshot_info(recipe.as_of)  # SnapshotError naming the ones there are
        admission.check_owner(self.store, recipe)

        def change(old: Entry | None) -> Recipe | None:
            if old is not None:
                _check_rollout_version(old.recipe, recipe)
            return None if old is not None and _same(old.recipe, recipe) else recipe

        self._priorities_written()
        stored, old = self.registry.install(recipe.name, change, self.host)
        if old is not None and stored is old.recipe:  # identical: this host is a reader now
            self._recipes[recipe.name] = stored
            self.request_fill(recipe.name)
            return stored
        live_only = old is not None and same_recipe(old.recipe, stored, ("version", "params"))
        self._installed(stored, reset=not live_only)
        return stored

    def set_params(self, name: str, **params: Any) -> Recipe:
        """Change live params (e.g. curriculum thresholds): the next batches use them.

        The recipe gets the next ``version``; queued batches of older versions are dropped
        (here and by every pop); augmentation statistics and samplers are kept. A recipe
        with ``admission`` declares its new policy version to the gateways here
        (``set_params(name, policy_version=v)`` after each update)."""

        def change(old: Entry | None) -> Recipe:
            if old is None:
                raise KeyError(f"recipe {name!r} is not registered in namespace {self.namespace!r}")
            data = old.recipe.model_dump()
            data["params"] = {**data["params"], **params}
            new = Recipe.model_validate(data)
            _check_rollout_version(old.recipe, new)
            return new

        # No reader host: a curriculum process reads nothing.
        self._priorities_written()
        recipe, _ = self.registry.install(name, change, None)
        self._installed(recipe, reset=False)
        return recipe

    def advance(self, name: str, version: int) -> Recipe:
        """``set_params(name, <version_param>=version)`` for a rollout recipe whose steps of
        ``version`` are not written yet (a learner starting its next rollout, as
        ``ClawRolloutBuffer.reset`` does): one script call instead of the recipe's
        transaction, the queue's drain and a fill task, as no fill could find those steps
        yet (the ingest commit that completes the rollout forms it, docs/recipes.md,
        "On-policy"). Falls back to :meth:`set_params` when another client changed the
        recipe since this one read it; ValueError for a recipe without ``rollout``."""
        current = self._recipes.get(name)
        if current is None:
            current = self._recipes[name] = self._entry(name).recipe
        ro = current.rollout
        if ro is None:
            raise ValueError(f"recipe {name!r} has no rollout section: use set_params")
        params = {**current.params, ro.version_param: version}
        recipe = current.model_copy(update={"params": params, "version": current.version + 1})
        self._priorities_written()
        dropped = self.registry.advance(recipe)
        if dropped is None:  # changed by another client: the full transaction
            return self.set_params(name, **{ro.version_param: version})
        giveback.drop(self.store, recipe, dropped)
        self._recipes[name] = recipe
        return recipe

    def restore(self, recipe: Recipe) -> Recipe:
        """Install ``recipe`` (as a snapshot recorded it) as its name's next version,
        whatever is registered now: queued batches are dropped and a fill is forced, as
        for any change. Adds no reader host (a rollback runs anywhere)."""
        self._priorities_written()
        stored, old = self.registry.install(recipe.name, lambda _: recipe, None)
        live_only = old is not None and same_recipe(old.recipe, stored, ("version", "params"))
        self._installed(stored, reset=not live_only)
        return stored

    def unregister(self, name: str) -> None:
        self._stop_ahead(name)
        for item in self.registry.remove(name):
            shm.discard(item)
        admission.clear(self.store, name)
        self._recipes.pop(name, None)

    def detached(self) -> BatchClient:
        """A new client of the same namespace, store and broker, without read-ahead (what a
        read-ahead thread pops with)."""
        return BatchClient(self.namespace, self.redis_url, broker_url=self.broker_url, readahead=0)

    def held(self, name: str) -> int:
        """Batches of recipe ``name`` read ahead in this process and not popped yet."""
        ra = self._ahead.get(name)
        return 0 if ra is None else len(ra)

    def _stop_ahead(self, name: str) -> None:
        ra = self._ahead.pop(name, None)
        if ra is not None:
            ra.close()  # the batches it held are dropped (their rows stay in the store)

    def _installed(self, recipe: Recipe, reset: bool) -> None:
        """After a new version: drop the queued batches (older versions, and those read
        ahead), reset the counters unless only live params changed, and ask for a fill."""
        self._stop_ahead(recipe.name)
        giveback.drop(self.store, recipe, self.registry.drain(recipe.name))
        if reset:
            self.store.r.delete(self.registry.counters(recipe.name))
        if recipe.admission is not None:
            admission.declare(self.store, recipe, fresh=reset)
        else:
            admission.clear(self.store, recipe.name)  # a new version without the section
        self._recipes[recipe.name] = recipe
        self.request_fill(recipe.name, force=True)

    def _entry(self, name: str) -> Entry:
        return self.registry.registered(name)

    def _priorities_written(self) -> None:
        """Wait for the priority updates submitted so far, before a recipe change is
        stored: any fill of the new version (this client's, the beat's, another
        trainer's) draws with them. A failed write is left to be raised by the priority
        calls (:meth:`update_priorities`), not by the recipe change."""
        if self._priorities is not None:
            self._priorities.wait()

    def _recipe(self, name: str) -> Recipe:
        """Recipe ``name`` as this client last knew it (read from the registry once)."""
        recipe = self._recipes.get(name)
        if recipe is None:
            recipe = self._recipes[name] = self._entry(name).recipe
        return recipe

    # ---- batches -------------------------------------------------------------------
    def pop(self, name: str, timeout: float | None = 30.0, *, policy_version: Any = None) -> Batch:
        """The next ready batch of recipe ``name``; raises TimeoutError after ``timeout``
        seconds (None waits forever) with the recipe's prefetch state in the message.

        Batches of a recipe version older than the current one (made while the recipe
        changed) are dropped. ``policy_version``: the update or policy this batch trains,
        recorded in the lineage log (:meth:`trained` records a batch popped earlier)."""
        recipe = self._recipe(name)
        # Not for rollout recipes, nor admission ones: read ahead of the trainer's next
        # set_params, a batch would be dropped by it (its data wasted)
        if self.readahead > 0 and recipe.rollout is None and recipe.admission is None:
            return self._pop_ahead(name, timeout, policy_version)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                item = self.next_item(name, left, explain=False)
            except TimeoutError:  # explained for the whole wait, not what was left of it
                raise TimeoutError(self.why_empty(name, timeout)) from None
            batch = self.accept(name, item)
            if batch is None:
                continue
            self._reports.popped(name)  # reported with the next pop
            if policy_version is not None:
                self.trained(name, batch, policy_version)
            return batch

    def next_item(self, name: str, timeout: float | None = 30.0, *, explain: bool = True) -> bytes:
        """The next raw item of recipe ``name``'s Redis queue, not decoded (what
        :meth:`pop` reads, and a read-ahead process hands its trainer): asks for a refill
        below low water; TimeoutError after ``timeout`` seconds, explaining why (unless
        not ``explain``: the explanation reads the recipe's stats)."""
        recipe = self._recipe(name)
        q = self.registry.queue(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        r = self.store.r
        # A rollout recipe's next rollout is formed by the commit that completes it (its
        # fill ran at set_params): an empty queue asks for a fill only after a first wait.
        empty_asks = recipe.rollout is None
        while True:
            with r.pipeline(transaction=False) as pipe:
                pipe.lpop(q)
                pipe.llen(q)
                self._reports.queue(pipe)
                item, left = pipe.execute()[:2]
            if left < (recipe.prefetch.low_water or 0) + (item is None and empty_asks):
                self._refills.put(name)  # sent off the trainer's path (~1 ms)
            if item is not None:
                return item
            empty_asks = True
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(self.why_empty(name, timeout) if explain else name)
            began = time.monotonic()
            got = r.blpop([q], timeout=max(wait, 0.01))
            self._reports.waited(name, time.monotonic() - began)
            if got is not None:
                return cast(bytes, got[1])

    def count_popped(self, name: str) -> None:
        """Count a batch of recipe ``name`` as popped (reported with the next pop): what a
        read-ahead process does for each item it hands its trainer."""
        self._reports.popped(name)

    def accept(self, name: str, item: bytes) -> Batch | None:
        """Decode queue item ``item`` of recipe ``name``; None when it is not to be served:
        unreadable (counted, skipped), its segment gone or on another host, or made for an
        older recipe version than this client knows (dropped, its rows given back; a newer
        one refreshes what it knows)."""
        recipe = self._recipe(name)
        try:
            batch = shm.from_message(item)
        except shm.SegmentMissing:
            return None  # reclaimed (its producer died long ago): take the next one
        except shm.ForeignSegment as e:  # made for a reader on another host
            log.warning("recipe %r: skipped a batch in another host's /dev/shm: %s", name, e)
            return None
        except WireVersionError:
            raise  # not garbage: this reader or the workers need an upgrade
        except Exception as e:  # garbage in the queue: skip it, never fail the trainer
            self._skip(name, item, e)
            return None
        if batch.recipe_version != recipe.version:  # changed here or by another client
            recipe = self._recipes[name] = self._entry(name).recipe
            if batch.recipe_version < recipe.version:  # stale: drop it (its segment,
                claims: list[Claim] = []  # if any, is unlinked already)
                n = giveback.unserved(batch, claims)
                giveback.give_back(self.store, recipe, n, claims, "a stale batch dropped")
                return None
        return batch

    def _pop_ahead(self, name: str, timeout: float | None, policy_version: Any) -> Batch:
        """:meth:`pop` from the recipe's read-ahead (started on first use)."""
        ra = self._ahead.get(name)
        if ra is None:
            ra = self._ahead[name] = ReadAhead(
                self, name, count=self.readahead, max_bytes=self.readahead_bytes
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            batch = ra.pop(left)
            version = self._recipes[name].version
            if batch.recipe_version > version:  # changed by another client
                self._recipes[name] = self._entry(name).recipe
            elif batch.recipe_version < version:  # read ahead before this client changed
                claim = getattr(batch, "claim", None)  # the recipe: stale
                if claim is not None:
                    giveback.give_back(self.store, self._recipes[name], 0, [claim], "stale")
                continue
            if policy_version is not None:
                self.trained(name, batch, policy_version)
                self._refills.put(_FLUSH)  # sent off the trainer's path: no pop goes out
            return batch

    def _skip(self, name: str, item: Any, error: Exception) -> None:
        """Drop an unreadable queue item: counted (``skipped`` in :meth:`stats`), logged
        once per recipe per client."""
        if self._reports.skipped(name):
            log.warning(
                "recipe %r: skipped an unreadable queue item (%d bytes): %s: %s (further "
                "ones are counted in stats()['skipped'], not logged)",
                name,
                len(item),
                type(error).__name__,
                error,
            )

    def trained(
        self, name: str, batch: Batch | Traced, policy_version: Any, *, at: float | None = None
    ) -> None:
        """Record that ``batch`` of recipe ``name`` (a batch, or a part of one: anything
        with its ``recipe_version`` and ``ids``) trains ``policy_version`` (any value; kept
        as text): one lineage entry, sent with the next pop (or :meth:`flush_lineage`,
        :meth:`stats`, :meth:`close`; by itself once
        :data:`~orchestrator.delivery.popreports.LINEAGE_PENDING` wait, for a client
        that declares batches another one pops). Record each batch once: here, or with
        ``pop``'s ``policy_version``. Thread-safe. The entry is encoded when it is sent (a
        read-ahead's trainer pays only this append), so ``batch.ids`` must not change
        meanwhile (its weights and source indexes are copied here). ``at``: when the
        batch was declared (default now; a read-ahead process records its trainer's
        declarations a few batches later)."""
        if self._reports.trained(name, batch, policy_version, at):
            self.flush_lineage()

    def flush_lineage(self) -> None:
        """Send the lineage entries recorded since the last pop."""
        if self._reports.pending():
            with self.store.r.pipeline(transaction=False) as pipe:
                self._reports.queue(pipe)
                pipe.execute()

    def _send_refills(self) -> None:
        while (name := self._refills.get()) is not None:
            try:
                if name is _FLUSH:
                    self.flush_lineage()
                else:
                    self.request_fill(name)
            except Exception:  # the beat safety net refills anyway; lineage goes next time
                log.warning("refill request for %r failed", name, exc_info=True)

    def request_fill(self, name: str, *, force: bool = False) -> bool:
        """Ask the prefetch workers to top up ``name``'s queue now (pops below low water and
        the beat do this on their own); unless ``force``, nothing is sent while a fill is on
        its way. True if this call asked."""
        token = self.registry.take_refill_lock(name, force=force)
        if token is None:
            return False
        try:
            self.app.send_task(
                "claw.prefetch.fill", args=[self.namespace, name, token], queue="prefetch"
            )
        except BaseException:  # no fill is on its way: the next pop (or beat) may ask again
            self.registry.release_refill_lock(name, token)
            raise
        return True

    def why_empty(self, name: str, timeout: float | None) -> str:
        """What the fill did: rate limited (its numbers and the rule), failed, short of
        data, or never ran because no worker consumes ``prefetch``."""
        st = self.stats(name)[name]
        limit = self._entry(name).recipe.rate_limit
        return why_empty(name, timeout, st, limit, lambda: prefetch_consumers(self.app))

    def nearest(
        self,
        states: Any,
        k: int = 10,
        *,
        index: str = "default",
        where: str | Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        fields: Sequence[str] = (),
        namespace: str | None = None,
    ) -> Neighbours:
        """The ``k`` nearest stored steps of each state in vector index ``index`` (of this
        client's namespace, or ``namespace``), among those ``where`` selects, with
        ``fields`` (e.g. the expert ``action``): :func:`orchestrator.retrieval.nearest`."""
        store = self.store if namespace is None else Store(self.store.r, namespace)
        return nearest(store, states, k, index=index, where=where, params=params, fields=fields)

    def update_priorities(
        self, ids: Sequence[int] | np.ndarray, priorities: Any, *, wait: bool = False
    ) -> int | None:
        """Set step priorities (e.g. |TD error|); ids evicted or overwritten are skipped.

        Written behind by default: the arrays are checked and copied here and a background
        :class:`~orchestrator.delivery.priorities.PriorityWriter` writes them in
        submission order (for an id updated twice, the later one wins); returns None.
        :meth:`flush_priorities` and :meth:`close` wait for every update submitted
        before them. A failed write is counted (:attr:`priority_errors`) and raised
        (``PriorityWriteError``) by the next call of this, ``flush_priorities`` or
        ``close`` (that call's own update is then not queued). A :meth:`pop` does not
        wait for them: the batch it returns was drawn before (prefetched), so waiting
        would delay the trainer and change no batch. A new recipe version
        (:meth:`register`, :meth:`set_params`, :meth:`advance`, :meth:`restore`) waits
        for them before it is stored (without raising their error): its batches are all
        drawn after it, and a trainer that changes the recipe to drop batches drawn
        before an update expects them to see it.

        ``wait=True``: write every earlier update and this one before returning (a round
        trip) and return how many steps this one updated."""
        if wait:
            self.flush_priorities()  # the earlier ones first: submission order
            return self.store.update_priorities(ids, priorities)
        if self._priorities is None:
            self._priorities = PriorityWriter(self.namespace, self._url)
        self._priorities.submit(ids, priorities)
        return None

    def flush_priorities(self, timeout: float | None = 30.0) -> int:
        """Wait until every priority update submitted so far is written; returns how many
        steps they updated since the last flush (raises ``PriorityWriteError`` if a write
        failed since the last such raise)."""
        return 0 if self._priorities is None else self._priorities.flush(timeout)

    @property
    def priority_errors(self) -> int:
        """Priority writes that failed behind the trainer's calls (each also raised once,
        see :meth:`update_priorities`)."""
        return 0 if self._priorities is None else self._priorities.errors

    def stats(self, name: str | None = None) -> dict[str, dict[str, Any]]:
        """Per recipe: queue depth and bound, batches produced and popped, rows sampled,
        steps inserted, the rate limiter's verdict and the last prefetch state; a rollout
        recipe's ``rollout``: rollouts formed, the policy version served, its minibatches
        pushed of all, steps dropped stale and steps lost (docs/recipes.md, "On-policy");
        an ``admission`` recipe's ``admission``: the budget and its counters
        (:func:`orchestrator.delivery.admission.state`) and ``served_staleness`` (batches,
        mean and max staleness in versions; docs/llm.md, "Admission"). The figures are
        :func:`~orchestrator.delivery.recipestats.recipe_stats`', which ``claw metrics``
        exports too."""
        self.flush_lineage()
        names = None if name is None else [name]
        found = recipe_stats(self.store, self.registry, names)
        return {n: st.to_json() for n, st in found.items()}

    def close(self) -> None:
        """Stop the read-aheads, write the pending priority updates and lineage, release
        the connections (raises a failed priority write's error last)."""
        for name in list(self._ahead):
            self._stop_ahead(name)
        try:  # the priorities written first; their error raised once all is released
            if self._priorities is not None:
                self._priorities.close()
        finally:
            self._refills.put(None)
            self._sender.join(timeout=5)
            try:
                self.flush_lineage()
            finally:
                self.store.r.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same(a: Recipe, b: Recipe) -> bool:
    """Equal but for the version (params count: changing them makes a new version)."""
    return same_recipe(a, b, ignore=("version",))


def _check_rollout_version(old: Recipe, new: Recipe) -> None:
    """A rollout recipe's policy version only grows (its rollouts are formed per version):
    refuse a registration or a param change that would move it back, before anything is
    stored. A learner restarting from a checkpoint registers with the version it resumes
    at (``recipe.params``), or unregisters the recipe to start over."""
    if old.rollout is None or new.rollout is None:
        return
    vp = new.rollout.version_param
    was, now = _version(old.params.get(vp, 0)), _version(new.params.get(vp, 0))
    if now < was:
        raise ValueError(
            f"recipe {new.name!r}: {vp} {now} is behind the registered {was} (a rollout "
            f"recipe's version only grows): register it with {vp}={was} or later to resume, "
            "or unregister it to start over"
        )


def _version(value: object) -> int:
    """A policy version param as an int (the recipe's validation made it a number)."""
    return int(value) if isinstance(value, int | float | str) else 0

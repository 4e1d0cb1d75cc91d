"""Registered recipes and their prefetch queues, in Redis (namespace keys ``claw:{ns}:``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.store import Store
from claw_tasks.store.batches import ACTIVE
from claw_tasks.store.scripts import Lua, execute
from orchestrator.recipe.model import Recipe, recipe_digest
from orchestrator.sampling.groups import claims_key

# ACTIVE: namespaces that have had recipes, for the beat refill (`claw drop` removes one).
# Written by the workers (a fill adds its namespace) and by :meth:`Registry.put` (setup with
# full access), never by a client: it writes only its namespace's keys, so a Redis ACL can
# confine it to them.
REFILL_LOCK_S = 30
DEFINITION_GRACE_S = 3600.0
"""A recipe version no lineage entry names yet is kept this long after it was stored: a
trainer may declare a batch it popped (a read-ahead's) well after the recipe changed."""
_UNLOCK = Lua("unlock", "orchestrator")
_ADVANCE = Lua("advance", "orchestrator")
_ROLLOUT_PUSH = Lua("rollout_push", "orchestrator")


@dataclass(frozen=True)
class Entry:
    """A registered recipe: the recipe (its ``version`` bumps on every change) and the hosts
    of the trainers that registered it (for the shared-memory fast path)."""

    recipe: Recipe
    reader_hosts: frozenset[str]
    registered: float

    @property
    def shm_host(self) -> str | None:
        """The host batches may go to through ``/dev/shm``: the only reader host; None (the
        queue holds the bytes) when readers are on several hosts, or none is known."""
        return next(iter(self.reader_hosts)) if len(self.reader_hosts) == 1 else None


# Fields of a recipe's counters hash (Registry.counters): batches the fill made and the
# rows they drew, batches trainers popped and skipped (stale), seconds trainers waited.
PRODUCED, SAMPLED, POPPED, SKIPPED, WAIT_S = "produced", "sampled", "popped", "skipped", "wait_s"


class Registry:
    """Recipe entries, queues, refill locks and prefetch counters of one namespace."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.r: redis.Redis = store.r
        self.ns = store.namespace

    def recipe_key(self, name: str) -> str:
        return self.store.owned_key(f"recipe:{name}")

    def queue(self, name: str) -> str:
        return self.store.owned_key(f"q:{name}")

    def refill_lock(self, name: str) -> str:
        return self.store.owned_key(f"refill:{name}")

    def augment_stats(self, name: str) -> str:
        """Hash: the running statistics of the recipe's augmentation (``augstats``)."""
        return self.store.owned_key(f"astats:{name}")

    def counters(self, name: str) -> str:
        """Hash of a recipe's counters (the fields ``PRODUCED`` ... ``WAIT_S`` and ``state``)."""
        return self.store.owned_key(f"pstats:{name}")

    def readers(self, name: str) -> str:
        """Set of the host ids of the trainers that registered ``name``."""
        return self.store.owned_key(f"readers:{name}")

    def rollout_keys(self, name: str) -> list[str]:
        """A rollout recipe's state, plan and the ids its rollouts took or counted stale
        (:mod:`orchestrator.delivery.rollouts`)."""
        return [self.store.owned_key(f"ro:{name}{part}") for part in ("", ":plan", ":seen")]

    @property
    def rollouts_waiting_key(self) -> str:
        """Set: the rollout recipes whose current rollout waits for steps. Each ingest commit
        in the namespace forms theirs if it is complete (:mod:`orchestrator.delivery.rollouts`)."""
        return self.store.owned_key("rowaiting")

    @property
    def versions_key(self) -> str:
        """Hash: recipe name -> its current version (read by every push: small and cheap)."""
        return self.store.owned_key("rversions")

    @property
    def names_key(self) -> str:
        return self.store.owned_key("recipes")

    @property
    def definitions_key(self) -> str:
        """Hash: recipe digest (:func:`~orchestrator.recipe.model.recipe_digest`) -> that
        version's definition and when it was stored: every version a lineage entry may name,
        kept while the log names it (:meth:`prune_definitions`)."""
        return self.store.owned_key("rdefs")

    def definition(self, digest: str) -> Recipe | None:
        """The recipe version of ``digest``; None when it is no longer kept."""
        raw = self.r.hget(self.definitions_key, digest)
        return None if raw is None else Recipe.model_validate(unpackb(raw)["recipe"])

    def prune_definitions(self, named: set[str], grace: float = DEFINITION_GRACE_S) -> int:
        """Drop the kept recipe versions no lineage entry names (``named``) that are not a
        recipe's current version and were stored more than ``grace`` seconds ago (a batch
        popped but not yet declared may still name them); returns how many."""
        current = set()
        for name in self.names():
            entry = self.get(name)
            if entry is not None:
                current.add(recipe_digest(entry.recipe))
        now, stale = time.time(), []
        for digest, raw in self.r.hscan_iter(self.definitions_key):
            d = digest.decode()
            if d in named or d in current:
                continue
            if now - float(unpackb(raw)["at"]) > grace:
                stale.append(d)
        if stale:
            self.r.hdel(self.definitions_key, *stale)
        return len(stale)

    def put(self, recipe: Recipe, reader_host: str | None) -> None:
        """Store ``recipe`` as it is, version included (setting a registry up, as a bench
        does); a client changing a recipe goes through :meth:`install`."""
        with self.r.pipeline(transaction=True) as pipe:
            self._queue_put(pipe, recipe)
            if reader_host is not None:
                pipe.sadd(self.readers(recipe.name), reader_host)
            pipe.execute()
        # Apart: the global set is in another slot than the namespace's keys (a cluster
        # runs one transaction in one slot). Added after the recipe, so the beat finds it.
        self.r.sadd(ACTIVE, self.ns)  # no client asks for a fill: let the beat see it

    def install(
        self, name: str, change: Callable[[Entry | None], Recipe | None], reader_host: str | None
    ) -> tuple[Recipe, Entry | None]:
        """Store ``change(current entry)`` as the recipe's next version and add
        ``reader_host`` to its readers (readers on other hosts stay: :meth:`remove` drops
        them); ``change`` returning None keeps the current recipe and version.

        Read, version and write are one transaction that watches the recipe's key and runs
        again when another client changed it in between: concurrent registrations and
        ``set_params`` never share a version, and none is lost. Returns the stored recipe
        and the entry it replaced."""
        key = self.recipe_key(name)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    old = self._entry(pipe.get(key), pipe.smembers(self.readers(name)))
                    new = change(old)
                    pipe.multi()
                    if new is None:
                        assert old is not None, "change() must make the first version"
                        recipe = old.recipe
                    else:
                        version = 1 if old is None else old.recipe.version + 1
                        recipe = new.model_copy(update={"version": version})
                        self._queue_put(pipe, recipe)
                    if reader_host is not None:
                        pipe.sadd(self.readers(name), reader_host)
                    pipe.execute()
                    return recipe, old
                except redis.WatchError:
                    continue

    def advance(self, recipe: Recipe) -> list[bytes] | None:
        """Store ``recipe`` (a rollout recipe's next version, made by the caller from the
        current one) in one script call, if the stored version is still the one before
        it; its queue is emptied and it waits for its rollout's steps
        (:data:`rollouts_waiting_key`). Returns the queued items dropped (to reclaim), or
        None when another client changed the recipe meanwhile (nothing written)."""
        name = recipe.name
        entry = packb({"recipe": recipe.model_dump(mode="json"), "at": time.time()})
        keys = [self.recipe_key(name), self.versions_key, self.queue(name)]
        keys.append(self.rollouts_waiting_key)
        args = [name, recipe.version - 1, recipe.version, entry]
        defs, digest = self.definitions_key, recipe_digest(recipe)

        def queue(p: redis.client.Pipeline) -> None:
            _ADVANCE.queue(p, keys, args)
            p.hset(defs, digest, entry)  # kept for replay: harmless if the advance lost

        items = execute(self.r, [_ADVANCE], queue)[0]
        return None if items is None else list(items)

    def push_rollout(
        self, name: str, no: int, cursor: int, rows: int, items: list[bytes]
    ) -> tuple[int, int | None, bool] | None:
        """Append minibatch ``items`` of rollout ``no`` of recipe ``name`` to its queue
        in one script call, if its state is still at ``cursor`` of that rollout, advancing
        the cursor and the produced and sampled (``rows`` a minibatch) counters with them.
        Returns the queue's length, the recipe's stored version (None: gone) and whether
        its entry exists; None when the state differs (nothing written)."""
        skey = self.rollout_keys(name)[0]
        keys = [skey, self.queue(name), self.counters(name), self.versions_key]
        keys.append(self.recipe_key(name))
        args = [name, no, cursor, rows, PRODUCED, SAMPLED, *items]
        got = execute(self.r, [_ROLLOUT_PUSH], lambda p: _ROLLOUT_PUSH.queue(p, keys, args))[0]
        if got is None:
            return None
        length, version, registered = got
        return int(length), int(version) if version else None, bool(registered)

    def _queue_put(self, pipe: redis.client.Pipeline, recipe: Recipe) -> None:
        entry = {"recipe": recipe.model_dump(mode="json"), "at": time.time()}
        pipe.set(self.recipe_key(recipe.name), packb(entry))
        pipe.hset(self.definitions_key, recipe_digest(recipe), packb(entry))
        pipe.hset(self.versions_key, recipe.name, recipe.version)
        pipe.sadd(self.names_key, recipe.name)

    def get(self, name: str) -> Entry | None:
        with self.r.pipeline(transaction=True) as pipe:
            pipe.get(self.recipe_key(name))
            pipe.smembers(self.readers(name))
            return self._entry(*pipe.execute())

    def registered(self, name: str) -> Entry:
        """:meth:`get`, or KeyError naming the recipe and namespace."""
        entry = self.get(name)
        if entry is None:
            raise KeyError(f"recipe {name!r} is not registered in namespace {self.ns!r}")
        return entry

    @staticmethod
    def _entry(raw: bytes | None, hosts: set[bytes]) -> Entry | None:
        if raw is None:
            return None
        d = unpackb(raw)
        readers = frozenset(h.decode() for h in hosts)
        return Entry(Recipe.model_validate(d["recipe"]), readers, d["at"])

    def version(self, name: str) -> int | None:
        """The recipe's current version (None when it is not registered)."""
        v = self.r.hget(self.versions_key, name)
        return None if v is None else int(v)

    def names(self) -> list[str]:
        return sorted(n.decode() for n in self.r.smembers(self.names_key))

    def remove(self, name: str) -> list[bytes]:
        """Drop a recipe with its queue; returns the queued items (to reclaim)."""
        with self.r.pipeline(transaction=True) as pipe:
            pipe.lrange(self.queue(name), 0, -1)
            pipe.delete(self.recipe_key(name), self.queue(name), self.counters(name))
            pipe.delete(self.refill_lock(name), self.readers(name), self.augment_stats(name))
            pipe.delete(claims_key(self.store, name), *self.rollout_keys(name))
            pipe.hdel(self.versions_key, name)
            pipe.srem(self.names_key, name)
            pipe.srem(self.rollouts_waiting_key, name)
            return pipe.execute()[0]

    def drain(self, name: str) -> list[bytes]:
        """Empty a queue (after a recipe change); returns the items."""
        with self.r.pipeline(transaction=True) as pipe:
            pipe.lrange(self.queue(name), 0, -1)
            pipe.delete(self.queue(name))
            return pipe.execute()[0]

    def take_refill_lock(self, name: str, *, force: bool = False) -> str | None:
        """Take the recipe's refill lock (expires after ``REFILL_LOCK_S``); returns the token
        the fill must release it with, or None when a fill is already on its way. ``force``
        takes it even then (after a recipe change: the running fill's pushes are stale)."""
        lock, token = self.refill_lock(name), secrets.token_hex(8)
        if force:
            self.r.set(lock, token, ex=REFILL_LOCK_S)
            return token
        return token if self.r.set(lock, token, nx=True, ex=REFILL_LOCK_S) else None

    def release_refill_lock(self, name: str, token: str) -> bool:
        """Drop the refill lock if it still holds ``token`` (not a later fill's lock)."""
        key = self.refill_lock(name)
        return bool(execute(self.r, [_UNLOCK], lambda p: _UNLOCK.queue(p, [key], [token]))[0])

    def inserted(self) -> int:
        """Steps ever committed to the namespace (sum of the shards' sequence counters)."""
        return sum(self.store.seqs())

    def fill_state(self, name: str) -> tuple[int, int, float, str]:
        """One round trip: queue length, steps inserted, rows sampled, last fill state."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.llen(self.queue(name))
            pipe.hmget(self.counters(name), [SAMPLED, "state"])
            self.store.queue_seqs(pipe)  # one GET per shard: a cluster has them apart
            length, (sampled, state), *seqs = pipe.execute()
        inserted = sum(int(v or 0) for v in seqs)
        return length, inserted, float(sampled or 0), (state or b"").decode()

    def bump(self, name: str, **counts: int | float | str) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            for k, v in counts.items():
                if isinstance(v, str):
                    pipe.hset(self.counters(name), k, v)
                else:
                    pipe.hincrbyfloat(self.counters(name), k, v)
            pipe.execute()

    def counts(self, name: str) -> dict[str, Any]:
        raw = self.r.hgetall(self.counters(name))
        out: dict[str, Any] = {}
        for k, v in raw.items():
            s = v.decode()
            try:
                out[k.decode()] = float(s)
            except ValueError:
                out[k.decode()] = s
        return out

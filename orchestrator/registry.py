"""Registered recipes and their prefetch queues, in Redis (namespace keys ``claw:{ns}:``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from claw_tasks.codec import packb, unpackb
from claw_tasks.store import Store
from orchestrator.recipe import Recipe

ACTIVE = "claw:active"  # set of namespaces with registered recipes (for the beat refill)
REFILL_LOCK_S = 30


@dataclass(frozen=True)
class Entry:
    """A registered recipe: the recipe (its ``version`` bumps on every change) and the host
    of the trainer that registered it (for the shared-memory fast path)."""

    recipe: Recipe
    reader_host: str | None
    registered: float


class Registry:
    """Recipe entries, queues, refill locks and prefetch counters of one namespace."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.r: redis.Redis = store.r
        self.ns = store.namespace
        self.base = store.keys.base

    def recipe_key(self, name: str) -> str:
        return f"{self.base}recipe:{name}"

    def queue(self, name: str) -> str:
        return f"{self.base}q:{name}"

    def refill_lock(self, name: str) -> str:
        return f"{self.base}refill:{name}"

    def counters(self, name: str) -> str:
        return f"{self.base}pstats:{name}"

    @property
    def names_key(self) -> str:
        return f"{self.base}recipes"

    def put(self, recipe: Recipe, reader_host: str | None) -> None:
        entry = {"recipe": recipe.model_dump(mode="json"), "host": reader_host, "at": time.time()}
        with self.r.pipeline() as pipe:
            pipe.set(self.recipe_key(recipe.name), packb(entry))
            pipe.sadd(self.names_key, recipe.name)
            pipe.sadd(ACTIVE, self.ns)
            pipe.execute()

    def get(self, name: str) -> Entry | None:
        raw = self.r.get(self.recipe_key(name))
        if raw is None:
            return None
        d = unpackb(raw)
        return Entry(Recipe.model_validate(d["recipe"]), d["host"], d["at"])

    def names(self) -> list[str]:
        return sorted(n.decode() for n in self.r.smembers(self.names_key))

    def remove(self, name: str) -> list[bytes]:
        """Drop a recipe with its queue; returns the queued items (to reclaim)."""
        with self.r.pipeline() as pipe:
            pipe.lrange(self.queue(name), 0, -1)
            pipe.delete(self.recipe_key(name), self.queue(name), self.counters(name))
            pipe.delete(self.refill_lock(name))
            pipe.srem(self.names_key, name)
            items = pipe.execute()[0]
        if not self.r.scard(self.names_key):
            self.r.srem(ACTIVE, self.ns)
        return items

    def drain(self, name: str) -> list[bytes]:
        """Empty a queue (after a recipe change); returns the items."""
        with self.r.pipeline() as pipe:
            pipe.lrange(self.queue(name), 0, -1)
            pipe.delete(self.queue(name))
            return pipe.execute()[0]

    def inserted(self) -> int:
        """Steps ever committed to the namespace (sum of the shards' sequence counters)."""
        cfg = self.store.config()
        keys = [self.store.keys.shard_key(s, "seq") for s in range(cfg.n_shards)]
        return sum(int(v or 0) for v in self.r.mget(keys))

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

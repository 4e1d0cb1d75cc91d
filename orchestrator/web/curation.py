"""Curation and recipes: labelling episodes and steps (every recipe of the namespace then
moves to a new version), each recipe's candidates, stats and live params."""

from __future__ import annotations

import json
import time
from typing import Any

from claw_tasks.where import Where
from orchestrator.delivery.registry import Registry
from orchestrator.inspect.query import Query
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.candidates import eligible
from orchestrator.web.access import Access


class CurationViews(Access):
    """``curate``, ``recipes`` and ``set_params``, and the candidate count they show."""

    # ---- curation and recipes ----------------------------------------------------------
    def candidates(self, q: Query, recipe: Recipe) -> int:
        """Steps the recipe's sources may draw from now (alive, trainable, matching)."""
        cols, now = q.index.columns, time.time()
        ok = eligible(cols)
        total = 0
        for src in recipe.sources:
            where = Where(src.where, q.tags, q.strings.encode)
            total += int((ok & where.mask(cols, recipe.params, now=now)).sum())
        return total

    def curate(
        self,
        ns: str,
        who: str,
        *,
        episodes: list[str],
        ids: list[int],
        trainable: bool | None,
        quality: str | None,
        tags: dict[str, str | float],
    ) -> dict[str, Any]:
        """Label the episodes and steps, then move every recipe of the namespace to a new
        version (so batches queued before the labels are dropped, here and at pop).
        Returns the steps labelled and each recipe's candidates before and after."""
        store = self.store(ns)
        registry = Registry(store)
        recipes = [e.recipe for n in registry.names() if (e := registry.get(n)) is not None]
        with self.lock(ns):
            q = self.query(ns)
            before = {r.name: self.candidates(q, r) for r in recipes}
        labels = {"trainable": trainable, "quality": quality, "tags": tags or None, "by": who}
        done = 0
        for name in episodes:
            done += store.curate(episode_id=name, **labels)
        if ids:
            done += store.curate(ids, **labels)
        versions = {}
        client = self.client(ns) if recipes else None
        for r in recipes:
            assert client is not None
            versions[r.name] = client.set_params(r.name).version
        with self.lock(ns):
            q = self.query(ns)
            after = {r.name: self.candidates(q, r) for r in recipes}
        return {
            "steps": done,
            "recipes": [
                {
                    "name": r.name,
                    "before": before[r.name],
                    "after": after[r.name],
                    "old_version": r.version,
                    "version": versions[r.name],
                }
                for r in recipes
            ],
        }

    def recipes(self, ns: str) -> list[dict[str, Any]]:
        store = self.store(ns)
        registry = Registry(store)
        names = registry.names()
        stats = self.client(ns).stats() if names else {}
        out = []
        for n in names:
            entry = registry.get(n)
            if entry is None or n not in stats:
                continue
            out.append(
                {
                    "name": n,
                    "recipe": entry.recipe,
                    **stats[n],
                    "params": {k: json.dumps(v) for k, v in entry.recipe.params.items()},
                }
            )
        return out

    def set_params(self, ns: str, who: str, name: str, raw: dict[str, str]) -> Recipe:
        """Parse each value as JSON (a bare word is a string) and set the recipe's live
        params; raises ValueError (pydantic's, or ours) naming what is wrong."""
        params: dict[str, Any] = {}
        for k, text in raw.items():
            try:
                params[k] = json.loads(text)
            except json.JSONDecodeError:
                params[k] = text
        store = self.store(ns)
        schema = store.schema()
        entry = Registry(store).get(name)
        if entry is None:
            raise KeyError(f"recipe {name!r} is not registered in {ns!r}")
        candidate = Recipe.model_validate(
            {**entry.recipe.model_dump(), "params": {**entry.recipe.params, **params}}
        )
        if schema is not None:
            candidate.validate_against(schema)
        recipe = self.client(ns).set_params(name, **params)
        store.audit(
            who, "set_params", {"recipe": name, "params": params, "version": recipe.version}
        )
        return recipe

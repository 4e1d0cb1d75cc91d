"""The recipe: the declarative batch spec every stage reads (sampling, delivery,
maintenance). Its ``where`` filters are the language of :mod:`claw_tasks.where`. It names
no sampler kind but the default: the samplers register theirs
(:data:`~orchestrator.recipe.sources.SAMPLER_KINDS`).

``model`` holds ``Recipe`` and its checks; ``base`` the types every section uses,
``sources`` the sources and sampler specs, ``options`` the optional sections (prefetch,
rate limit, tokens, rollout, admission, nearest), ``joint`` the multi-agent keys."""

from orchestrator.recipe.model import Recipe, same_recipe

__all__ = ["Recipe", "same_recipe"]

"""The recipe: the declarative batch spec every stage reads (sampling, delivery,
maintenance). Its ``where`` filters are the language of :mod:`claw_tasks.where`. It names
no sampler kind but the default: the samplers register theirs
(:data:`~orchestrator.recipe.sources.SAMPLER_KINDS`)."""

from orchestrator.recipe.model import Recipe, same_recipe

__all__ = ["Recipe", "same_recipe"]

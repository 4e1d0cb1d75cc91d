"""The recipe: the declarative batch spec every stage reads (sampling, delivery,
maintenance). Its ``where`` filters are the language of :mod:`claw_tasks.where`."""

from orchestrator.recipe.model import Recipe, same_recipe

__all__ = ["Recipe", "same_recipe"]

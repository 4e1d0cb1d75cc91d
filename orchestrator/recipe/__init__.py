"""The recipe: the declarative batch spec every stage reads (sampling, delivery,
maintenance), and the ``where`` filter language it uses."""

from orchestrator.recipe.model import Recipe, same_recipe

__all__ = ["Recipe", "same_recipe"]

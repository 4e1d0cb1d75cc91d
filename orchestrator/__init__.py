"""Claw's orchestrator: recipes, the sampling index and samplers, augmentation, delivery."""

from orchestrator.recipe import Recipe
from orchestrator.samplers import InsufficientData
from orchestrator.sampling import SampledBatch, sample, update_priorities

__all__ = ["InsufficientData", "Recipe", "SampledBatch", "sample", "update_priorities"]

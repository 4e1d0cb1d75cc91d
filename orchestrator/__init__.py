"""Claw's orchestrator: recipes, the sampling index and samplers, augmentation, delivery."""

from typing import TYPE_CHECKING, Any

from orchestrator.recipe.model import Recipe
from orchestrator.sampling.sample import SampledBatch, sample, update_priorities
from orchestrator.sampling.samplers import InsufficientData

if TYPE_CHECKING:
    from orchestrator.delivery.client import BatchClient

__all__ = [
    "BatchClient",
    "InsufficientData",
    "Recipe",
    "SampledBatch",
    "sample",
    "update_priorities",
]


def __getattr__(name: str) -> Any:
    # BatchClient pulls in the Celery app; import it only when asked for.
    if name == "BatchClient":
        from orchestrator.delivery.client import BatchClient

        return BatchClient
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")

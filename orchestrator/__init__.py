"""Claw's orchestrator: recipes, the sampling index and samplers, augmentation, delivery."""

from typing import TYPE_CHECKING, Any

from orchestrator.recipe import Recipe
from orchestrator.samplers import InsufficientData
from orchestrator.sampling import SampledBatch, sample, update_priorities

if TYPE_CHECKING:
    from orchestrator.client import BatchClient

__all__ = [
    "BatchClient", "InsufficientData", "Recipe", "SampledBatch", "sample", "update_priorities",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    # BatchClient pulls in the Celery app; import it only when asked for.
    if name == "BatchClient":
        from orchestrator.client import BatchClient

        return BatchClient
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")

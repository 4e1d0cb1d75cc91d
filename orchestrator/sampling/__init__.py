"""What to draw: the in-process sampling index, samplers, n-step and sequence windows,
and ``sample()``, which turns a recipe into one batch of rows read from the store."""

from orchestrator.sampling.sample import SampledBatch, sample, update_priorities
from orchestrator.sampling.samplers import InsufficientData

__all__ = ["InsufficientData", "SampledBatch", "sample", "update_priorities"]

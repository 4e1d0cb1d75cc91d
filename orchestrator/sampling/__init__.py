"""What to draw: the in-process sampling index, samplers, n-step and sequence windows,
and ``sample()``, which turns a recipe into one batch of rows read from the store."""

from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.sample import SampledBatch, sample, update_priorities

__all__ = ["InsufficientData", "SampledBatch", "sample", "update_priorities"]

"""What to draw: the in-process sampling index, samplers, n-step and sequence windows,
and ``sample()``, which turns a recipe into one batch of rows read from the store.

``samplers/`` holds one module per ``sampler.kind``: its recipe keys and its class behind
the one :class:`~orchestrator.sampling.samplers.base.Sampler` contract, added with
``@register`` (which also gives the recipe the kind's name and keys)."""

from orchestrator.sampling.batch import Batch
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.sample import sample, update_priorities

__all__ = ["Batch", "InsufficientData", "sample", "update_priorities"]

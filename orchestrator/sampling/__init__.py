"""What to draw: the sampling index (in-process or shared by a host's workers), samplers,
n-step and sequence windows, frame stacks, and ``sample()``, which turns a recipe into one
:class:`~orchestrator.sampling.batch.Batch` of rows read from the store.

``samplers/`` holds one module per ``sampler.kind``: its recipe keys and its class behind
the one :class:`~orchestrator.sampling.samplers.base.Sampler` contract, added with
``@register`` (which also gives the recipe the kind's name and keys)."""

from orchestrator.sampling.batch import Batch
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.sample import sample, update_priorities

__all__ = ["Batch", "InsufficientData", "sample", "update_priorities"]

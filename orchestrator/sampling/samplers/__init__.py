"""Samplers: how a recipe source draws its rows, one kind per module.

A source's candidates are the rows that are alive, trainable and match its ``where``
(:mod:`orchestrator.sampling.candidates`); its ``sampler.kind`` picks the class that draws
from them:

- ``uniform`` (:mod:`.uniform`), ``priority`` (:mod:`.priority`): with replacement, within
  the source's window (:mod:`.rows`), over sum trees kept current from the changed rows;
- ``recent`` (:mod:`.recent`): the newest candidates, without replacement;
- ``group`` (:mod:`.group`): whole groups of trajectories, for GRPO.

A source that cannot fill its rows raises
:class:`~orchestrator.sampling.candidates.InsufficientData` (a batch is never smaller):
``recent`` needs as many candidates (in its window) as it has rows, the samplers with
replacement need one.

:mod:`.base` is the contract (:class:`Sampler`) and the registry (:data:`SAMPLERS`,
:func:`register`); :mod:`.mixture` draws a recipe's batch from its sources' samplers. A new
kind is a new module here that defines its spec and its class with ``@register``, named
in :data:`KINDS`: the recipe then accepts its ``kind`` and keys.
"""

import importlib

from orchestrator.sampling.samplers.base import SAMPLERS, Context, Part, Sampler, register
from orchestrator.sampling.samplers.mixture import Draw, RecipeSampler

KINDS = ("uniform", "priority", "recent", "group")
"""The sampler modules, imported (registered) in this order: the order docs/recipes.md and
a recipe's error for an unknown kind list them in."""

for _module in KINDS:
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["SAMPLERS", "Context", "Draw", "Part", "RecipeSampler", "Sampler", "register"]

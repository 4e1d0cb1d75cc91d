"""Claw's read path: a recipe turned into the batches a trainer pops, and what runs around it.

The stages, each importing only those above it in this list (and any layer of
``claw_tasks``, the write path, which never imports this package; ``tests/unit/test_layers.py``
checks both):

- ``transforms``  augmentation ops a recipe names and frame stacks: numpy and OpenCV
                  (albumentations when a recipe names it), no Redis, no Celery
- ``recipe``      the recipe model: the declarative batch spec every stage below reads
- ``sampling``    what to draw: the sampling index (a numpy mirror of the store's metadata,
                  one per host in ``/dev/shm``), samplers, n-step and sequence windows,
                  frame stacks, the payload fetch, ``sample()`` and the ``Batch`` it returns
- ``retrieval``   nearest-neighbour search by state: vector indexes over a payload field
                  (Faiss), kept current by the maintenance beat, ``nearest()``
- ``delivery``    how a batch reaches the trainer: the prefetch task, collation and token
                  batches, the wire format, shared memory, the recipe registry, the rate
                  limiter, read-ahead, ``BatchClient``
- ``maintenance`` what beat runs: refill, retention and eviction, priority recomputation,
                  dictionary pruning, vector indexes, archive and restore;
                  namespace drop
- ``adapters``    other libraries' interfaces: PyTorch, Stable-Baselines3, TorchRL, Ray
                  RLlib, Minari, LLM trainers' tensors, TRL's GRPOTrainer rollouts (each
                  imported on its own: torch, TorchRL, RLlib and TRL are extras)
- ``inspect``     read-only views for people: namespace statistics, the query engine
                  and the replay of the batches a policy trained on
- ``web``         the web inspector (``claw web``)
- ``gateway``     the OpenAI-compatible capture gateway (``claw gateway``)
- ``cli``         the ``claw`` command, its dev tools (dev stack, doctor, the Prometheus
                  exporter) and the demo

``orchestrator/lua/`` holds the read path's Redis scripts (package data). This module sits
on top of every stage, and no stage imports it: it is the public facade (``Recipe``,
``sample``, ``update_priorities``, ``Batch``, ``InsufficientData``; ``BatchClient``,
``nearest``, ``define_index``, ``update_indexes`` and ``define_source``, imported on first
use so that ``import orchestrator`` builds no Celery app and loads no retrieval code).
Importing it also registers the sampler kinds (``sampling.samplers``) whose names and keys
the recipe accepts: Python runs it before any ``orchestrator.recipe`` import.
"""

from typing import TYPE_CHECKING, Any

from orchestrator.recipe.model import Recipe
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.sample import sample, update_priorities
from orchestrator.sampling.samplers import SAMPLERS  # noqa: F401  (registers the recipe's kinds)

if TYPE_CHECKING:
    from orchestrator.delivery.client import BatchClient
    from orchestrator.maintenance.cleaning import define_source
    from orchestrator.maintenance.vectors import update_indexes
    from orchestrator.retrieval import define_index, nearest

__all__ = [
    "Batch",
    "BatchClient",
    "InsufficientData",
    "Recipe",
    "define_index",
    "define_source",
    "nearest",
    "sample",
    "update_indexes",
    "update_priorities",
]

_LAZY = {
    "BatchClient": "orchestrator.delivery.client",
    "define_index": "orchestrator.retrieval",
    "define_source": "orchestrator.maintenance.cleaning",
    "nearest": "orchestrator.retrieval",
    "update_indexes": "orchestrator.maintenance.vectors",
}


def __getattr__(name: str) -> Any:
    # BatchClient pulls in the Celery app, the others the retrieval and maintenance code:
    # imported only when asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")

"""Nearest-neighbour retrieval by state: vector indexes over a namespace's payload fields.

An index is defined per namespace (:func:`define_index`, ``claw nearest NS --define``):
which field, which projection of it (a slice, a downscaled image, an allowlisted feature
function), which metric, exact or approximate (Faiss IVF). The maintenance beat
(``claw.maintenance.vectors``) projects new steps and writes their vectors to Redis as raw
arrays; every process that queries (trainers, prefetch workers) keeps its own copy, loaded
from those arrays and caught up from the index's log, and checks each answer against the
store before returning it, so no evicted step is ever returned. docs/retrieval.md is the
reference (keys, costs, limits).

- ``engine``    Faiss, imported on first use (the ``retrieval`` extra)
- ``spec``      the definition and the projection it names
- ``storage``   the index's Redis keys: definitions, vectors, ids, list assignments, log
- ``writer``    what the maintenance task runs: project new steps, train, persist
- ``vectors``   the in-process copy: exact and IVF search under a row mask
- ``query``     :func:`nearest`: where-restricted, validated, with the fields asked for

Imports ``sampling`` (its index gives the metadata a ``where`` reads, its fetch the
validated reads) and ``transforms``; ``delivery`` and ``maintenance`` import it.
"""

from orchestrator.retrieval.query import Neighbours, nearest
from orchestrator.retrieval.spec import IndexSpec, SpecError
from orchestrator.retrieval.storage import define_index, drop_index, list_indexes

__all__ = [
    "IndexSpec",
    "Neighbours",
    "SpecError",
    "define_index",
    "drop_index",
    "list_indexes",
    "nearest",
]

"""The Redis step store. ``Store`` is one namespace, composed of one part per concern:
namespace admin, string dictionaries, reads, counting, updates, eviction and writes. Its
Lua scripts are package data in ``claw_tasks/lua/``. Imports ``format``, ``where``,
``connection``, ``codecs``, ``settings`` and ``durations``."""

from claw_tasks.store.commit import CommitResult
from claw_tasks.store.config import NamespaceConfig, NamespaceDropped, NamespaceError
from claw_tasks.store.count import Counting
from claw_tasks.store.evict import Eviction
from claw_tasks.store.reader import decode_meta
from claw_tasks.store.updates import Updates
from claw_tasks.store.writer import Writer


class Store(Eviction, Updates, Counting, Writer):
    """One namespace of the step store. Cheap to construct; safe to share in a process."""


__all__ = [
    "CommitResult",
    "NamespaceConfig",
    "NamespaceDropped",
    "NamespaceError",
    "Store",
    "decode_meta",
]

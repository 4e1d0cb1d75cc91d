"""The Redis step store. ``Store`` is one namespace: a :class:`StoreCore` (client, keys,
scripts, dictionaries, the cached config) composing one part per concern, each in its own
module and given only the core and the parts it calls:

=============  ==============  ==============================================================
part           module          methods
=============  ==============  ==============================================================
(the core)     ``core``        ``config``, ``revalidate``; attributes ``r``, ``keys``,
                               ``namespace``, ``scripts``, ``dicts``
``admin``      ``admin``       ``exists``, ``create``, ``ensure_schema``, ``schema``,
                               ``set_retention``, ``set_episode_index``,
                               ``set_priority_rules``, ``set_spaces``
``dicts``      ``dicts``       ``encode_strings``, ``lookup_codes``, ``decode_codes``
``reader``     ``reader``      ``locate``, ``get``, ``episode``, ``trajectory_ids``,
                               ``read_meta``, ``meta_columns``, ``read_fields``,
                               ``read_frames``, ``info``
``counting``   ``count``       ``count``
``updates``    ``updates``     ``update_priorities``, ``update_rewards``, ``curate``,
                               ``audit``, ``audit_log``
``eviction``   ``evict``       ``evict``, ``evict_slots``, ``evictions``
``writer``     ``writer``      ``commit``, ``allocate``, ``place`` (one shard's commit:
                               ``commit.CommitPart``)
=============  ==============  ==============================================================

The store's own modules import only downward: ``layout``, ``scripts``, ``config``,
``dicts``, ``core``, then the parts, then this package. Range reads for archival are
functions over a core (``scan``), as are stored LLM turns (``turns``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import redis

from claw_tasks.store.admin import Admin
from claw_tasks.store.commit import CommitResult
from claw_tasks.store.config import NamespaceConfig, NamespaceDropped, NamespaceError
from claw_tasks.store.core import StoreCore
from claw_tasks.store.count import Counting
from claw_tasks.store.dicts import Dictionaries
from claw_tasks.store.evict import Eviction
from claw_tasks.store.reader import Reader, decode_meta
from claw_tasks.store.updates import Updates
from claw_tasks.store.writer import Writer

P = ParamSpec("P")
R = TypeVar("R")


def _on(part: str, method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """``Store.<name>``: ``method`` called on the store's ``part`` (its signature and
    docstring; ``__wrapped__`` is the part's method)."""

    @functools.wraps(method)
    def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(self, part), *args, **kwargs)

    return call


class Store(StoreCore):
    """One namespace of the step store. Cheap to construct; safe to share in a process."""

    def __init__(self, client: redis.Redis | str, namespace: str) -> None:
        super().__init__(client, namespace)
        self.admin = Admin(self)
        self.reader = Reader(self)
        self.counting = Counting(self, self.reader)
        self.updates = Updates(self, self.reader)
        self.eviction = Eviction(self, self.reader)
        self.writer = Writer(self, self.admin)

    exists = _on("admin", Admin.exists)
    create = _on("admin", Admin.create)
    ensure_schema = _on("admin", Admin.ensure_schema)
    schema = _on("admin", Admin.schema)
    set_retention = _on("admin", Admin.set_retention)
    set_episode_index = _on("admin", Admin.set_episode_index)
    set_priority_rules = _on("admin", Admin.set_priority_rules)
    set_spaces = _on("admin", Admin.set_spaces)

    encode_strings = _on("dicts", Dictionaries.encode_strings)
    lookup_codes = _on("dicts", Dictionaries.lookup_codes)
    decode_codes = _on("dicts", Dictionaries.decode_codes)

    locate = _on("reader", Reader.locate)
    get = _on("reader", Reader.get)
    episode = _on("reader", Reader.episode)
    trajectory_ids = _on("reader", Reader.trajectory_ids)
    read_meta = _on("reader", Reader.read_meta)
    meta_columns = _on("reader", Reader.meta_columns)
    read_fields = _on("reader", Reader.read_fields)
    read_frames = _on("reader", Reader.read_frames)
    info = _on("reader", Reader.info)

    count = _on("counting", Counting.count)

    update_priorities = _on("updates", Updates.update_priorities)
    update_rewards = _on("updates", Updates.update_rewards)
    curate = _on("updates", Updates.curate)
    audit = _on("updates", Updates.audit)
    audit_log = _on("updates", Updates.audit_log)

    evict = _on("eviction", Eviction.evict)
    evict_slots = _on("eviction", Eviction.evict_slots)
    evictions = _on("eviction", Eviction.evictions)

    commit = _on("writer", Writer.commit)
    allocate = _on("writer", Writer.allocate)
    place = _on("writer", Writer.place)


__all__ = [
    "CommitResult",
    "NamespaceConfig",
    "NamespaceDropped",
    "NamespaceError",
    "Store",
    "StoreCore",
    "decode_meta",
]

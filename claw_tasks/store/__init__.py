"""The Redis step store. ``Store`` is one namespace: a :class:`StoreCore` (client, keys,
scripts, dictionaries, the cached config) whose methods each belong to one part, in its
own module. A part holds no state of its own: it is made over the core for the call, and
uses only the core's API and the few parts it names in its constructor.

====================  ======================================================================
module                ``Store`` methods
====================  ======================================================================
``core``              ``config``, ``revalidate``, ``owned_key``, ``queue_config``,
                      ``mark_dropped``; attributes ``r``, ``layout_keys``, ``namespace``,
                      ``scripts``, ``dicts``
``admin``             ``exists``, ``create``, ``ensure_schema``, ``schema``,
                      ``set_retention``, ``set_episode_index``, ``set_priority_rules``,
                      ``set_spaces``
``dicts``             ``encode_strings``, ``lookup_codes``, ``decode_codes``
``reader``            ``locate``, ``get``, ``episode``, ``trajectory_ids``, ``read_meta``,
                      ``meta_columns``, ``read_fields``, ``read_frames``, ``read_info``,
                      ``info``
``count``             ``count``
``shards``            ``seqs``, ``seq``, ``queue_seqs``, ``watermarks``,
                      ``queue_watermarks``, ``set_watermark``,
                      ``episode_names``, ``holding``, ``dead_letters``
``updates``           ``update_priorities``, ``update_rewards``, ``curate``, ``audit``,
                      ``audit_log``
``evict``             ``evict``, ``evict_slots``, ``evictions``
``snapshots``         ``snapshot``, ``snapshots``, ``snapshot_info``, ``drop_snapshot``,
                      ``prune_snapshots``, ``labels``, ``rollback``, ``as_of_columns``
``snapshot_archive``  ``export_snapshot``, ``import_snapshot``
``writer``            ``commit`` (one shard's part of it: ``commit.CommitPart``), ``allocate``,
                      ``place``, ``shards_of``
====================  ======================================================================

Functions over a core, for the code above the store: range reads for archival and
quality (``scan``), stored LLM turns (``turns``), per-slot arrays a reader keeps beside the
steps (``arrays``), priority passes (``reprioritize``), dictionary pruning
(``dictprune``), key memory and field sizes (``usage``); ``keyscan`` lists namespaces and
parses key names, ``check`` is ``claw doctor``'s check (above this package: it uses
``Store``). The sampling read path's reads (``slots``: rows, slot spans, names;
``changes``: the change logs) are queued on a batch of ``connection.resp`` with their
decoders, so that a caller's reads of every kind stay one round trip. ``labels`` is the
snapshots' data (a namespace's mutable state, its diff) and ``snapshot_format`` a
snapshot's stored form (name, header, packed columns), no Redis.
``replication`` runs a write and its ``WAIT`` on the master of a key's slot (a commit
confirmed only once replicas have it). ``batches`` names what a batch leaves outside the
step data (its claim-check staging key, its done record, a placed batch's marker, dead
letters) and the names outside every namespace, for the sender, the ingest worker and
the beat. ``row_episode_codes`` is the shard of each row (a row's episode decides it), for
a sender splitting a batch by shard.
Only this package builds keys or reads the layout: the code above it asks for arrays and
names its own keys with ``owned_key``. The store's modules import only downward:
``layout``, ``scripts``, ``replication``, ``config``, ``dicts``, ``core``, the parts, then
this package.
Its Lua scripts are package data in ``claw_tasks/lua/``. Imports ``format``, ``where``,
``connection``, ``codecs``, ``settings`` and ``durations``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from claw_tasks.store.admin import Admin
from claw_tasks.store.commit import CommitResult
from claw_tasks.store.config import NamespaceConfig, NamespaceDropped, NamespaceError
from claw_tasks.store.core import StoreCore, owned_key
from claw_tasks.store.count import Counting
from claw_tasks.store.dicts import Dictionaries
from claw_tasks.store.evict import Eviction
from claw_tasks.store.layout import column_dtype, meta_chunk_of, meta_spans, row_episode_codes
from claw_tasks.store.reader import Reader, decode_meta
from claw_tasks.store.shards import Shards
from claw_tasks.store.snapshot_archive import SnapshotArchive
from claw_tasks.store.snapshots import Snapshots
from claw_tasks.store.updates import Updates
from claw_tasks.store.writer import Writer

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def _on(
    part: Callable[[StoreCore], T], method: Callable[Concatenate[T, P], R]
) -> Callable[Concatenate[StoreCore, P], R]:
    """A ``Store`` method: ``method`` of the ``part`` made over the store (its signature,
    docstring and ``__qualname__``, which names the part: ``Updates.curate``)."""

    @functools.wraps(method)
    def call(store: StoreCore, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(part(store), *args, **kwargs)

    return call


def _dicts(core: StoreCore) -> Dictionaries:
    return core.dicts


class Store(StoreCore):
    """One namespace of the step store. Cheap to construct; safe to share in a process."""

    exists = _on(Admin, Admin.exists)
    create = _on(Admin, Admin.create)
    clear_tombstone = _on(Admin, Admin.clear_tombstone)
    ensure_schema = _on(Admin, Admin.ensure_schema)
    schema = _on(Admin, Admin.schema)
    set_retention = _on(Admin, Admin.set_retention)
    set_episode_index = _on(Admin, Admin.set_episode_index)
    set_priority_rules = _on(Admin, Admin.set_priority_rules)
    set_spaces = _on(Admin, Admin.set_spaces)

    encode_strings = _on(_dicts, Dictionaries.encode_strings)
    lookup_codes = _on(_dicts, Dictionaries.lookup_codes)
    decode_codes = _on(_dicts, Dictionaries.decode_codes)

    locate = _on(Reader, Reader.locate)
    get = _on(Reader, Reader.get)
    episode = _on(Reader, Reader.episode)
    trajectory_ids = _on(Reader, Reader.trajectory_ids)
    read_meta = _on(Reader, Reader.read_meta)
    meta_columns = _on(Reader, Reader.meta_columns)
    read_fields = _on(Reader, Reader.read_fields)
    read_frames = _on(Reader, Reader.read_frames)
    read_info = _on(Reader, Reader.read_info)
    info = _on(Reader, Reader.info)

    count = _on(Counting, Counting.count)

    seqs = _on(Shards, Shards.seqs)
    queue_seqs = _on(Shards, Shards.queue_seqs)
    seq = _on(Shards, Shards.seq)
    queue_watermarks = _on(Shards, Shards.queue_watermarks)
    watermarks = _on(Shards, Shards.watermarks)
    set_watermark = _on(Shards, Shards.set_watermark)
    episode_names = _on(Shards, Shards.episode_names)
    holding = _on(Shards, Shards.holding)
    dead_letters = _on(Shards, Shards.dead_letters)

    update_priorities = _on(Updates, Updates.update_priorities)
    update_rewards = _on(Updates, Updates.update_rewards)
    curate = _on(Updates, Updates.curate)
    audit = _on(Updates, Updates.audit)
    audit_log = _on(Updates, Updates.audit_log)

    evict = _on(Eviction, Eviction.evict)
    evict_slots = _on(Eviction, Eviction.evict_slots)
    evictions = _on(Eviction, Eviction.evictions)

    snapshot = _on(Snapshots, Snapshots.snapshot)
    snapshots = _on(Snapshots, Snapshots.snapshots)
    snapshot_info = _on(Snapshots, Snapshots.snapshot_info)
    drop_snapshot = _on(Snapshots, Snapshots.drop_snapshot)
    export_snapshot = _on(SnapshotArchive, SnapshotArchive.export_snapshot)
    import_snapshot = _on(SnapshotArchive, SnapshotArchive.import_snapshot)
    prune_snapshots = _on(Snapshots, Snapshots.prune)
    labels = _on(Snapshots, Snapshots.labels)
    rollback = _on(Snapshots, Snapshots.rollback)
    as_of_columns = _on(Snapshots, Snapshots.as_of_columns)

    commit = _on(Writer, Writer.commit)
    allocate = _on(Writer, Writer.allocate)
    place = _on(Writer, Writer.place)
    shards_of = _on(Writer, Writer.shards_of)


__all__ = [
    "CommitResult",
    "NamespaceConfig",
    "NamespaceDropped",
    "NamespaceError",
    "Store",
    "StoreCore",
    "column_dtype",
    "decode_meta",
    "meta_chunk_of",
    "meta_spans",
    "owned_key",
    "row_episode_codes",
]

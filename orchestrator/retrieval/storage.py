"""A vector index in Redis: its namespace-level keys, and its per-slot arrays (the store's
:class:`~claw_tasks.store.arrays.SlotArrays`) read and written as raw arrays (never
pickled).

Namespace level (``claw:{ns}:``): ``vx`` (hash: index name -> its definition as JSON),
``vx:<name>`` (hash: ``dim``; ``created``, the namespace config's creation time the index
belongs to; ``gen``, 0 until the IVF quantizer is trained, then 1, one more each time it
is trained again; ``nlist`` and ``centroids`` as raw float32; ``trained``, the vectors
there were when it was last trained, and ``trained_id`` the newest step id then;
``nprobe``, ``recall``, ``recall_bound`` and ``calibrated``, the calibrated search
breadth, its sample's recall@10 and lower bound, and the vectors there were then; ``runs``
and ``pending``, the writer's ticks and the steps it had left after the last),
``vx:<name>:log`` (stream: one entry per write, ``rows`` the global rows ``shard * cap +
slot`` written, as ``<i8``; ``gen`` when the quantizer was trained; ``nprobe`` when it was
calibrated again), ``vx:<name>:lock`` (the writer's lock: one maintenance task at a time
writes an index).

Slot arrays ``vx:<name>``, indexed by slot like the store's columns: ``v`` float32
vectors of ``dim``, ``i`` the ``<i8`` id of the step each vector was computed from (0:
none; a slot whose id differs holds another step now), ``a`` the ``<i4`` IVF list + 1 of
each vector under the latest generation (0: not assigned).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import redis
from redis.typing import EncodableT

from claw_tasks.store import Store
from claw_tasks.store.arrays import SlotArrays
from claw_tasks.store.changes import LOG_SINCE, page_commands, page_replies
from claw_tasks.store.config import LOG_MAXLEN
from claw_tasks.store.scripts import execute
from orchestrator.retrieval.calibrate import Calibration
from orchestrator.retrieval.spec import IndexSpec, Projection, SpecError, spec_of

LOCK_TTL_S = 120
LOG_PAGE = 1000


def defs_key(store: Store) -> str:
    return store.owned_key("vx")


def define_index(
    store: Store, spec: IndexSpec | Mapping[str, Any], *, replace: bool = False
) -> IndexSpec:
    """Define a vector index of ``store``'s namespace (the maintenance beat builds it).

    Defining the same index again changes nothing; another definition under the same name
    is an error unless ``replace``, which drops the old vectors first."""
    spec = spec_of(spec)
    schema = store.schema() if store.exists() else None
    if schema is not None:
        check_field(spec, schema.fields)
    old = store.r.hget(defs_key(store), spec.name)
    if old is not None:
        if stored_spec(old) == spec:
            return spec
        if not replace:
            raise SpecError(
                f"vector index {spec.name!r} of {store.namespace!r} is defined otherwise: "
                "pass replace=True (--replace) to drop it and build it anew"
            )
        drop_index(store, spec.name)
    store.r.hset(defs_key(store), spec.name, spec.model_dump_json())
    return spec


def check_field(spec: IndexSpec, fields: Mapping[str, Any]) -> Projection:
    """The projection of ``spec`` over its field in a schema's ``fields``."""
    fs = fields.get(spec.field)
    if fs is None:
        raise SpecError(f"field {spec.field!r} is not a field of the namespace ({sorted(fields)})")
    if fs.ragged:
        raise SpecError(f"field {spec.field!r} is ragged: an index needs a fixed shape")
    if np.dtype(fs.dtype).kind not in "biuf":
        raise SpecError(f"field {spec.field!r} is {fs.dtype}: an index needs numbers")
    return Projection(spec, tuple(fs.shape), allowed=(spec.feature,) if spec.feature else ())


def list_indexes(store: Store) -> dict[str, IndexSpec]:
    """The namespace's vector indexes by name."""
    raw = cast(dict[bytes, bytes], store.r.hgetall(defs_key(store)))
    return {k.decode(): stored_spec(v) for k, v in sorted(raw.items())}


def stored_spec(raw: bytes | str) -> IndexSpec:
    """A definition as stored (JSON). One without ``recall`` holds the fixed ``nprobe``
    12 that was the default when it was written: it is read as unset (calibrated)."""
    data = json.loads(raw)
    if "recall" not in data and data.get("nprobe") == 12:
        data["nprobe"] = None
    return spec_of(data)


def drop_index(store: Store, name: str) -> int:
    """Delete index ``name``'s definition and every key of it; returns keys deleted."""
    names = IndexKeys(store, name)
    cfg = store.config(refresh=True) if store.exists() else None
    head = store.r.hgetall(names.head)
    doomed = [names.head, names.log, names.lock]

    def undefine(pipe: Any) -> None:
        pipe.hdel(defs_key(store), name)

    if cfg is not None and head.get(b"dim"):
        arrays = vector_arrays(store, name, int(head[b"dim"]))
        return arrays.clear(also=doomed, then=undefine)
    with store.r.pipeline(transaction=False) as pipe:
        for key in doomed:  # one DEL per key: a cluster pipeline routes each to its slot
            pipe.delete(key)
        undefine(pipe)
        return sum(int(n) for n in pipe.execute()[: len(doomed)])


def vector_arrays(store: Store, name: str, dim: int) -> SlotArrays:
    """Index ``name``'s slot arrays: vectors ``v``, ids ``i``, list assignments ``a``."""
    return SlotArrays(store, name, {"v": ("<f4", (dim,)), "i": ("<i8", ()), "a": ("<i4", ())})


class IndexKeys:
    """Namespace-level key names of one vector index."""

    def __init__(self, store: Store, name: str) -> None:
        self.head = store.owned_key(f"vx:{name}")
        self.log = self.head + ":log"
        self.lock = self.head + ":lock"


@dataclass
class Head:
    """What ``vx:<name>`` holds."""

    dim: int
    created: float
    gen: int = 0
    nlist: int = 0
    centroids: np.ndarray | None = None
    trained: int = 0  # vectors there were when the quantizer was last trained
    nprobe: int = 0  # the calibrated nprobe (0: not calibrated)
    calibrated: int = 0  # vectors there were when it was calibrated
    trained_id: int = 0  # the newest step id the last training could have sampled


@dataclass
class Rows:
    """Vectors, ids and list assignments of some rows (or of all of them)."""

    vectors: np.ndarray  # float32 (n, dim)
    ids: np.ndarray  # int64 (n,): the step each vector belongs to (0: none)
    assign: np.ndarray  # int32 (n,): IVF list + 1 (0: none)


class Storage:
    """Reads and writes one index's keys; ``dim`` is its vectors' length."""

    def __init__(self, store: Store, spec: IndexSpec, dim: int) -> None:
        cfg = store.config()
        self.store, self.r, self.spec, self.dim = store, store.r, spec, dim
        self.names = IndexKeys(store, spec.name)
        self.n_shards, self.cap = cfg.n_shards, cfg.cap
        self.created = cfg.created
        self.arrays = vector_arrays(store, spec.name, dim)

    # ---- head ------------------------------------------------------------------------
    def head(self) -> Head | None:
        """The index's head, or None when it was never written or belongs to an older
        namespace of the same name (another config ``created``)."""
        h = cast(dict[bytes, bytes], self.r.hgetall(self.names.head))
        if not h or float(h[b"created"]) != self.created or int(h[b"dim"]) != self.dim:
            return None
        gen, nlist = int(h.get(b"gen", 0)), int(h.get(b"nlist", 0))
        cent = None
        if gen and h.get(b"centroids"):
            cent = np.frombuffer(h[b"centroids"], "<f4").reshape(nlist, self.dim).copy()
        return Head(
            self.dim,
            self.created,
            gen,
            nlist,
            cent,
            int(h.get(b"trained", 0)),
            int(h.get(b"nprobe", 0)),
            int(h.get(b"calibrated", 0)),
            int(h.get(b"trained_id", 0)),
        )

    def reset_head(self) -> None:
        """A fresh head for this namespace: every old vector is stale (ids no longer
        match, or the index is recreated), so the old keys go first."""
        fresh = {"dim": self.dim, "created": repr(self.created)}
        self.arrays.clear(
            also=[self.names.log, self.names.head],
            then=lambda pipe: pipe.hset(self.names.head, mapping=fresh),
        )

    def set_trained(
        self,
        centroids: np.ndarray,
        vectors: int,
        calibration: Calibration | None = None,
        newest: int = 0,
    ) -> int:
        """Publish a trained quantizer (the next generation; ``vectors`` there were; its
        calibrated ``nprobe``) and tell readers (a ``gen`` entry: they reload, the
        assignments having been written first). Returns the generation."""
        mapping: dict[EncodableT, EncodableT] = {
            "nlist": len(centroids),
            "centroids": np.ascontiguousarray(centroids, "<f4").tobytes(),
            "trained": vectors,
            "trained_id": newest,
        }
        if calibration is not None:
            mapping.update(self._calibration(calibration, vectors))
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hincrby(self.names.head, "gen", 1)
            pipe.hset(self.names.head, mapping=mapping)
            gen = int(pipe.execute()[0])
        self.r.xadd(self.names.log, {"gen": gen}, maxlen=LOG_MAXLEN, approximate=True)
        return gen

    @staticmethod
    def _calibration(calibration: Calibration, vectors: int) -> dict[EncodableT, EncodableT]:
        return {
            "nprobe": calibration.nprobe,
            "recall": repr(calibration.recall),
            "recall_bound": repr(calibration.bound),
            "calibrated": vectors,
        }

    def set_calibrated(self, calibration: Calibration, vectors: int) -> None:
        """Publish a new calibrated ``nprobe`` for the current quantizer (``vectors``
        there were) and tell readers (an ``nprobe`` entry: they take it, no reload)."""
        self.r.hset(self.names.head, mapping=self._calibration(calibration, vectors))
        self.r.xadd(
            self.names.log,
            {"nprobe": calibration.nprobe},
            maxlen=LOG_MAXLEN,
            approximate=True,
        )

    def ran(self, done: Mapping[str, Any]) -> None:
        """Count a writer's tick in the head (``runs``, ``pending``: what ``claw stats`` and
        the tests read)."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hincrby(self.names.head, "runs", 1)
            pipe.hset(self.names.head, "pending", int(done.get("pending", 0)))
            pipe.execute()

    # ---- lock ------------------------------------------------------------------------
    def lock(self) -> str | None:
        token = uuid.uuid4().hex
        return token if self.r.set(self.names.lock, token, nx=True, ex=LOCK_TTL_S) else None

    def renew(self, token: str) -> bool:
        """Extend the lock by ``LOCK_TTL_S`` while it is still ``token``'s."""
        with self.r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.names.lock)
                if pipe.get(self.names.lock) != token.encode():
                    return False
                pipe.multi()
                pipe.expire(self.names.lock, LOCK_TTL_S)
                pipe.execute()
                return True
            except redis.WatchError:
                return False

    def unlock(self, token: str) -> None:
        if self.r.get(self.names.lock) == token.encode():
            self.r.delete(self.names.lock)

    # ---- rows ------------------------------------------------------------------------
    def write(self, rows: np.ndarray, data: Rows, log: bool = True) -> None:
        """Write ``data`` at global ``rows`` (sorted), then log them (a second round trip:
        a reader that sees the entry finds the bytes, on a cluster too)."""
        self.arrays.write(rows, {"v": data.vectors, "i": data.ids, "a": data.assign})
        if log:
            self.r.xadd(
                self.names.log,
                {"rows": rows.astype("<i8").tobytes()},
                maxlen=LOG_MAXLEN,
                approximate=True,
            )

    def write_assign(self, rows: np.ndarray, assign: np.ndarray) -> None:
        """List assignments only (after training), not logged: the ``gen`` entry is."""
        self.arrays.write(rows, {"a": assign})

    def read(self, rows: np.ndarray) -> Rows:
        """Vectors, ids and assignments at global ``rows`` (sorted), one round trip."""
        got = self.arrays.read(rows)
        return Rows(got["v"], got["i"], got["a"])

    def read_all(self, kinds: tuple[str, ...] = ("v", "i", "a")) -> dict[str, np.ndarray]:
        """Whole arrays over every row (``shard * cap + slot``): a cold load, chunk by
        chunk (one round trip per shard)."""
        return self.arrays.read_all(kinds)

    def log_position(self) -> tuple[str, int]:
        """The log's last entry and its count of entries added (read before a cold load:
        whatever is written after it is replayed)."""
        try:
            info = self.r.xinfo_stream(self.names.log)
        except Exception:  # no log yet
            return "0-0", 0
        return info["last-generated-id"].decode(), int(info.get("entries-added", 0))

    def log_since(self, last: str, seen: int) -> tuple[bool, list[tuple[bytes, dict]]]:
        """Log entries after ``last``; True first when some were lost (trimmed)."""

        def queue(pipe: Any) -> None:
            for command in page_commands(self.names.log, last, seen, LOG_PAGE):
                pipe.execute_command(*command)

        ((lost, entries),) = page_replies(execute(self.r, [LOG_SINCE], queue))
        return lost, entries

    def log_and_get(
        self, last: str, seen: int, read: Callable[[Any], None]
    ) -> tuple[bool, list[tuple[bytes, dict]], bytes | None]:
        """:meth:`log_since` and the reply of the one read ``read`` queues (of a
        namespace-level key: the same slot) in one round trip."""

        def queue(pipe: Any) -> None:
            for command in page_commands(self.names.log, last, seen, LOG_PAGE):
                pipe.execute_command(*command)
            read(pipe)

        *page, value = execute(self.r, [LOG_SINCE], queue)
        ((lost, entries),) = page_replies(page)
        return lost, entries, value

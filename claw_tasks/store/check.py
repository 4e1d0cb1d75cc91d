"""Consistency checks of one namespace's store and indexes (``claw doctor``): every key
has the layout's type and size, ids map back to their slots, links and dictionaries agree.
Above the store's parts: it reads keys directly, as only the store may."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import redis

from claw_tasks.codecs import CodecError
from claw_tasks.format.schema import SchemaError, tag_column, tag_name
from claw_tasks.format.stepmeta import DICT_COLUMNS, EXPLICIT_NEXT, TERMINATED, TRUNCATED
from claw_tasks.store import NamespaceConfig, NamespaceError, Store
from claw_tasks.store.keyscan import NamespaceKey, scan_keys
from claw_tasks.store.layout import (
    ARRAYS_PREFIX,
    META,
    META_CHUNK_SLOTS,
    NUM_TAG_DTYPE,
    RUN_CHUNK_SLOTS,
    RUN_COLUMNS,
    RUN_ENTRY,
    SPARSE_CHUNK_SLOTS,
    STR_TAG_DTYPE,
    Keys,
    payload_chunk_slots,
)

CHECKS: dict[str, str] = {
    "config": "the config key exists and parses",
    "keys": "store keys have the layout's type; every shard key is part of the layout",
    "chunks": "column, payload and bitmap keys have the layout's size; run tables are sorted",
    "expiry": "staging keys and batch markers expire; no processed batch is still staged",
    "ids": "each alive slot holds an id that maps back to that slot",
    "links": "next links point at live steps of the same episode with step_index + 1",
    "next_obs": "steps flagged with an explicit next_obs have it stored",
    "dicts": "dictionaries are inverse maps and know every code and episode in use",
}
_EXPIRING = ("stage:", "done:", "dl:", "b:")  # keys written with a TTL


@dataclass(frozen=True)
class Problem:
    check: str
    where: str
    detail: str


@dataclass
class Report:
    namespace: str
    checked: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, check: str, where: str, detail: str) -> None:
        self.problems.append(Problem(check, where, detail))

    def failed(self, check: str) -> int:
        return sum(p.check == check for p in self.problems)


@dataclass(frozen=True)
class _Expect:
    type: str
    size: int | None = None  # STRLEN, for fixed-size strings
    block: int | None = None  # slots of a run table's block


def check_namespace(r: redis.Redis, namespace: str) -> Report:
    """Run every check in CHECKS on `namespace`; a broken config stops the rest."""
    report = Report(namespace)
    keys = list(scan_keys(r, namespace))
    report.checked.append("config")
    cfg = _config(r, namespace, len(keys), report)
    if cfg is None:
        return report
    store = Store(r, namespace)
    _check_keys(r, cfg, keys, report)
    report.checked += ["ids", "links", "next_obs", "dicts"]
    codes: dict[str, set[int]] = {}
    for shard in range(cfg.n_shards):
        cols = _check_shard(store, cfg, shard, report)
        for col, values in cols.items():
            codes.setdefault(col, set()).update(values.tolist())
    _check_dicts(store, codes, report)
    return report


def _config(r: redis.Redis, namespace: str, n_keys: int, report: Report) -> NamespaceConfig | None:
    raw = r.get(Keys(namespace).config)
    if raw is None:
        report.add("config", "config", f"missing, but {n_keys} other key(s) use the namespace")
        return None
    try:
        cfg = NamespaceConfig.from_bytes(raw, namespace)
    except (CodecError, SchemaError, NamespaceError, KeyError, TypeError, ValueError) as e:
        report.add("config", "config", f"does not parse: {type(e).__name__}: {e}")
        return None
    if cfg.capacity < 1 or cfg.n_shards < 1:
        report.add("config", "config", f"capacity {cfg.capacity}, {cfg.n_shards} shard(s)")
        return None
    return cfg


# ---- keys -----------------------------------------------------------------------------
def _check_keys(
    r: redis.Redis, cfg: NamespaceConfig, keys: list[NamespaceKey], rep: Report
) -> None:
    rep.checked += ["keys", "chunks", "expiry"]
    with r.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.type(k.key)
            pipe.ttl(k.key)
        replies = pipe.execute()
    sized: list[tuple[NamespaceKey, int]] = []
    tables: list[tuple[NamespaceKey, int]] = []
    for i, k in enumerate(keys):
        kind, ttl = replies[2 * i].decode(), replies[2 * i + 1]
        if ttl == -2:  # expired since the scan
            continue
        where = _where(k)
        try:
            expect = _expected(k, cfg)
        except ValueError as e:
            rep.add("keys", where, str(e))
            continue
        if expect is None:
            continue
        if kind != expect.type:
            rep.add("keys", where, f"is a {kind}, the layout has a {expect.type}")
            continue
        if expect.size is not None:
            sized.append((k, expect.size))
        if expect.block is not None:
            tables.append((k, expect.block))
        if k.name.startswith(_EXPIRING) and ttl == -1:
            rep.add("expiry", where, "has no TTL: it would never expire")
    _check_sizes(r, sized, rep)
    _check_run_tables(r, tables, rep)
    _check_staged(r, keys, rep)


def _where(k: NamespaceKey) -> str:
    return k.name if k.shard is None else f"shard {k.shard} {k.name}"


def _expected(k: NamespaceKey, cfg: NamespaceConfig) -> _Expect | None:
    """What the store layout says key `k` is; ValueError if a shard has no such key. None for
    other namespace-level keys: the delivery side keeps recipes and queues there."""
    name, schema, cap = k.name, cfg.schema, cfg.cap
    if k.shard is None:
        if name == "config":
            return _Expect("string")
        if name == "dead":
            return _Expect("stream")
        if name.startswith(("dict:", "rdict:")):
            return _Expect("hash")
        if name.startswith(("stage:", "done:", "dl:")):
            return _Expect("string")
        return None
    if k.shard >= cfg.n_shards:
        raise ValueError(f"shard {k.shard} does not exist ({cfg.n_shards} shard(s))")
    fixed = {
        "seq": "string",
        "evicted": "string",
        "evictions": "hash",
        "archived": "string",
        "links": "hash",
        "epname": "hash",
        "eplast": "hash",
        "eptraj": "hash",
        "prune": "hash",
        "log": "stream",
    }
    if name in fixed:
        return _Expect(fixed[name])
    if name == "alive":
        return _Expect("string", math.ceil(cap / 8))
    if name.startswith(("b:", "stage:")):  # claim checks may live in shard 0's slot
        return _Expect("string")
    if name.startswith(ARRAYS_PREFIX):  # slot arrays (arrays.SlotArrays)
        return _Expect("string")
    if name.startswith("psnap:"):  # a priority pass's snapshot of an m:priority chunk
        return _Expect("string", _chunk_slots(int(name[6:]), META_CHUNK_SLOTS, cap) * 4)
    kind, _, rest = name.partition(":")
    base, _, chunk_text = rest.rpartition(":")
    if not chunk_text.isdigit():
        raise ValueError("unknown shard key")
    chunk = int(chunk_text)
    if kind == "mr":
        if base not in RUN_COLUMNS:
            raise ValueError(f"{base!r} is not a run-table column")
        return _Expect("string", block=_chunk_slots(chunk, RUN_CHUNK_SLOTS, cap))
    if kind == "m":
        if base in RUN_COLUMNS:
            raise ValueError(f"{base!r} is stored as run tables (mr:), not as an m: column")
        itemsize = _column_itemsize(base, cfg)
        return _Expect("string", _chunk_slots(chunk, META_CHUNK_SLOTS, cap) * itemsize)
    spec = schema.fields.get(base) if schema else None
    if kind == "f" and spec is not None and not spec.ragged and spec.codec is None:
        cs = payload_chunk_slots(spec.row_bytes)
        return _Expect("string", _chunk_slots(chunk, cs, cap) * spec.row_bytes)
    sparse = spec is not None and (
        (kind == "r" and spec.ragged and spec.codec is None) or (kind == "z" and spec.codec)
    )
    if sparse or (kind in ("nx", "info") and not base):
        _chunk_slots(chunk, SPARSE_CHUNK_SLOTS, cap)
        return _Expect("hash")
    raise ValueError(f"no {kind!r} key for {base!r} in the schema")


def _column_itemsize(col: str, cfg: NamespaceConfig) -> int:
    if col in META:
        return META[col].itemsize
    tag = tag_name(col)
    kind = cfg.schema.tags.get(tag) if cfg.schema and tag is not None else None
    if kind is None:
        raise ValueError(f"metadata column {col!r} is neither built in nor a schema tag")
    return (STR_TAG_DTYPE if kind == "str" else NUM_TAG_DTYPE).itemsize


def _chunk_slots(chunk: int, per_chunk: int, cap: int) -> int:
    """Slots in chunk `chunk`; ValueError past the ring's last chunk."""
    slots = min(per_chunk, cap - chunk * per_chunk)
    if slots <= 0:
        raise ValueError(f"chunk {chunk} is past capacity ({cap} slots per shard)")
    return slots


def _check_sizes(r: redis.Redis, sized: list[tuple[NamespaceKey, int]], rep: Report) -> None:
    with r.pipeline(transaction=False) as pipe:
        for k, _ in sized:
            pipe.strlen(k.key)
        lengths = pipe.execute()
    for (k, want), got in zip(sized, lengths, strict=True):
        if got and got != want:
            rep.add("chunks", _where(k), f"{got} bytes, the layout says {want}")


def _check_run_tables(r: redis.Redis, tables: list[tuple[NamespaceKey, int]], rep: Report) -> None:
    """Each run table is whole records whose first slots increase inside the block."""
    with r.pipeline(transaction=False) as pipe:
        for k, _ in tables:
            pipe.get(k.key)
        raws = pipe.execute()
    for (k, block), raw in zip(tables, raws, strict=True):
        if raw is None:
            continue
        if len(raw) % RUN_ENTRY.itemsize:
            rep.add("chunks", _where(k), f"{len(raw)} bytes: not whole run records")
            continue
        first = np.frombuffer(raw, RUN_ENTRY)["slot"].astype(np.int64)
        if (np.diff(first) <= 0).any() or (len(first) and first[-1] >= block):
            rep.add("chunks", _where(k), f"run starts not increasing inside {block} slots")


def _check_staged(r: redis.Redis, keys: list[NamespaceKey], rep: Report) -> None:
    staged = [k for k in keys if k.name.startswith("stage:")]
    if not staged:
        return
    keys_of = Keys(staged[0].namespace)
    done = r.mget([keys_of.done(k.name.removeprefix("stage:")) for k in staged])
    for k, marker in zip(staged, done, strict=True):
        if marker is not None:
            rep.add("expiry", _where(k), "the batch was processed but its payload is still staged")


# ---- shards ---------------------------------------------------------------------------
def _check_shard(
    store: Store, cfg: NamespaceConfig, shard: int, rep: Report
) -> dict[str, np.ndarray]:
    """Ids, links and explicit next_obs of one shard; returns the dictionary codes in use."""
    tags = cfg.schema.tags if cfg.schema else {}
    str_tags = [tag_column(t) for t, kind in tags.items() if kind == "str"]
    dict_cols = [*DICT_COLUMNS, *str_tags]
    cols = store.meta_columns(shard, ["id", "episode", "step_index", "next", "flags", *dict_cols])
    seq_now = store.seq(shard)  # after the columns: a step committed since is not past it
    slots = np.flatnonzero(cols["alive"])
    ids = cols["id"][slots]
    n = cfg.n_shards
    seqs = ids // n
    bad = (ids <= 0) | (ids % n != shard) | ((seqs - 1) % cfg.cap != slots) | (seqs > seq_now)
    for slot, i in zip(slots[bad].tolist(), ids[bad].tolist(), strict=True):
        rep.add("ids", f"shard {shard} slot {slot}", _id_problem(i, slot, shard, cfg, seq_now))
    good = slots[~bad]
    _check_links(cols, good, cfg, shard, seq_now, rep)
    _check_explicit_next(store, cols, good, shard, rep)
    in_use = {c: np.unique(cols[c][good]) for c in dict_cols}
    in_use["episode"] = np.unique(cols["episode"][good])
    _check_episode_names(store, shard, in_use.pop("episode"), rep)
    return in_use


def _id_problem(i: int, slot: int, shard: int, cfg: NamespaceConfig, seq_now: int) -> str:
    if i <= 0:
        return f"alive but holds no id ({i})"
    seq = i // cfg.n_shards
    if seq > seq_now:
        return f"id {i} is beyond the shard's sequence counter ({seq_now})"
    return f"id {i} belongs to slot {(seq - 1) % cfg.cap} of shard {i % cfg.n_shards}"


def _check_links(
    cols: dict[str, np.ndarray],
    slots: np.ndarray,
    cfg: NamespaceConfig,
    shard: int,
    seq_now: int,
    rep: Report,
) -> None:
    ids, alive, n, cap = cols["id"], cols["alive"], cfg.n_shards, cfg.cap
    delta = cols["next"][slots].astype(np.int64)
    flags = cols["flags"][slots]
    linked = (delta != 0) & ((flags & EXPLICIT_NEXT) == 0)
    for slot in slots[linked & ((flags & (TERMINATED | TRUNCATED)) != 0)].tolist():
        rep.add("links", f"shard {shard} slot {slot}", "the episode ends here but next is set")
    src = slots[linked]
    target_seq = ids[src] // n + delta[linked]
    tslot = (target_seq - 1) % cap
    held = ids[tslot]
    held_seq = held // n
    is_target = (held == target_seq * n + shard) & alive[tslot]
    dangling = (target_seq < 1) | (target_seq > seq_now) | (~is_target & (held_seq < target_seq))
    same_ep = cols["episode"][tslot] == cols["episode"][src]
    next_idx = cols["step_index"][tslot] == cols["step_index"][src] + 1
    wrong = is_target & ~(same_ep & next_idx)
    for j in np.flatnonzero(dangling | wrong).tolist():
        s, t = int(src[j]), int(tslot[j])
        where = f"shard {shard} slot {s} (id {int(ids[s])})"
        target = int(target_seq[j] * n + shard)
        if dangling[j]:
            rep.add("links", where, f"next points at id {target}, which was never written")
        elif not same_ep[j]:
            rep.add("links", where, f"next points at id {target} of another episode")
        else:
            got = int(cols["step_index"][t])
            want = int(cols["step_index"][s]) + 1
            rep.add("links", where, f"next points at step_index {got}, expected {want}")


def _check_explicit_next(
    store: Store, cols: dict[str, np.ndarray], slots: np.ndarray, shard: int, rep: Report
) -> None:
    flagged = slots[(cols["flags"][slots] & EXPLICIT_NEXT) != 0].tolist()
    with store.r.pipeline(transaction=False) as pipe:
        for slot in flagged:
            pipe.hexists(store.layout_keys.sparse(shard, "nx", slot // SPARSE_CHUNK_SLOTS), slot)
        found = pipe.execute()
    for slot, ok in zip(flagged, found, strict=True):
        if not ok:
            rep.add("next_obs", f"shard {shard} slot {slot}", "flagged, but no next_obs stored")


def _check_episode_names(store: Store, shard: int, codes: np.ndarray, rep: Report) -> None:
    names = store.r.hkeys(store.layout_keys.shard_key(shard, "epname"))
    missing = np.setdiff1d(codes, np.array([int(c) for c in names], np.int64)).tolist()
    if missing:
        rep.add("dicts", f"shard {shard} epname", f"no name for episode code(s) {_few(missing)}")


# ---- dictionaries ---------------------------------------------------------------------
def _check_dicts(store: Store, in_use: dict[str, set[int]], rep: Report) -> None:
    for col, codes in in_use.items():
        forward = store.r.hgetall(store.layout_keys.dict(col))
        for text, marked in store.r.hgetall(store.layout_keys.dpend(col)).items():  # being pruned
            forward.setdefault(text, marked.split(b":")[0])
        reverse = store.r.hgetall(store.layout_keys.rdict(col))
        counter = int(reverse.pop(b"0", 0))
        for text, code in forward.items():
            if reverse.get(code) != text:
                rep.add("dicts", f"dict:{col}", f"{text!r} -> {int(code)}, reverse map disagrees")
        for code, text in reverse.items():
            if forward.get(text) != code:
                rep.add("dicts", f"rdict:{col}", f"{int(code)} -> {text!r}, forward map disagrees")
            if int(code) > counter:
                rep.add("dicts", f"rdict:{col}", f"code {int(code)} > counter {counter}")
        unknown = sorted(c for c in codes if c > 0 and str(c).encode() not in reverse)
        if unknown:
            rep.add("dicts", f"rdict:{col}", f"codes in use but unknown: {_few(unknown)}")


def _few(values: Sequence[int], n: int = 10) -> str:
    head = ", ".join(str(v) for v in values[:n])
    return head + (f" (and {len(values) - n} more)" if len(values) > n else "")

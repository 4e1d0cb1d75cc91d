"""The store's read API for the code above it (``claw_tasks.store``): what the orchestrator
asks of it instead of building keys — shard counters and watermarks, episode names, whether
slots still hold steps, info, payload spans and runs, slot arrays, priority passes, the
namespace check, the keys it owns — each against what the same steps read through
``Store.get`` and in the round trips it promises, on a standalone Redis and on a 3-master
Redis Cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from redis.crc import key_slot

from claw_tasks.format.arrays import unpackb
from claw_tasks.format.stepmeta import episode_code
from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceConfig, NamespaceDropped, NamespaceError, Store
from claw_tasks.store import owned_key as namespace_owned_key
from claw_tasks.store.arrays import SlotArrays
from claw_tasks.store.check import check_namespace
from claw_tasks.store.dictprune import prune_column
from claw_tasks.store.keyscan import list_namespaces, namespace_keys, scan_keys
from claw_tasks.store.reprioritize import (
    drop_priority_snapshots,
    snapshot_priorities,
    write_priorities,
)
from claw_tasks.store.scan import read_fixed, read_meta_run, read_payload_run
from claw_tasks.store.usage import key_bytes
from claw_tasks.worker.deadletter import Letter, Target, finish
from orchestrator.delivery.registry import Registry
from tests.support.stepdata import batch, episode, interleave

pytestmark = [pytest.mark.both_stores, pytest.mark.store(capacity=600, n_shards=3)]
EPISODES = 6
LENGTH = 20


def _commit(store: Store) -> np.ndarray:
    """Six interleaved episodes of 20 steps (the last step of each truncated, with an
    explicit next_obs), the third step of each with an ``info``; returns their ids."""
    b = batch(interleave(*(episode(e, LENGTH, "truncated") for e in range(EPISODES))))
    b.info_rows = np.flatnonzero(b.step_index == 2).astype(np.int32)
    b.info = [{"row": int(r)} for r in b.info_rows]
    ids = store.commit(b, now=1000.0).ids
    assert (ids > 0).all()
    return ids


def _where(store: Store, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return store.locate(ids)


class RoundTrips:
    """Round trips a call makes through one client: each command it sends alone and each
    pipeline it executes count once (what a pipeline or a cluster client does inside
    one is not counted again)."""

    def __init__(self, r: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n, self.depth = 0, 0
        monkeypatch.setattr(r, "execute_command", self._counted(r.execute_command))
        with r.pipeline(transaction=False) as pipe:
            cls = type(pipe)
        monkeypatch.setattr(cls, "execute", self._counted_method(cls.execute))

    def _counted(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += self.depth == 0
            self.depth += 1
            try:
                return call(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted

    def _counted_method(self, method: Callable[..., Any]) -> Callable[..., Any]:
        counted = self._counted(method)
        return lambda pipe, *args, **kwargs: counted(pipe, *args, **kwargs)

    def of(self, call: Callable[[], Any]) -> int:
        """The round trips ``call()`` makes."""
        self.n = 0
        call()
        return self.n


@pytest.fixture
def trips(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[RoundTrips]:
    yield RoundTrips(store.r, monkeypatch)


def test_reads_take_their_round_trips(store: Store, trips: RoundTrips) -> None:
    ids = _commit(store)
    shards, slots = _where(store, ids)
    codes = np.array([episode_code(n) for n in store.get(ids, fields=[])["episode_id"]])
    store.holding(shards, slots, ids // 3)  # scripts loaded: a NOSCRIPT retry is not counted
    cap = store.config().cap
    assert trips.of(store.seqs) == 1
    assert trips.of(lambda: store.episode_names(shards, codes)) == 1
    assert trips.of(lambda: store.holding(shards, slots, ids // 3)) == 1
    assert trips.of(lambda: store.read_info(shards, slots)) == 1
    assert trips.of(lambda: read_fixed(store, 0, 0, cap, ["obs", "action"])) == 1
    kinds = {"v": ("<f4", (3,)), "n": ("<i8", ())}
    rows = np.array([0, 1, cap, 2 * cap + 5], np.int64)
    values = {"v": np.ones((4, 3), np.float32), "n": np.arange(4, dtype=np.int64)}
    SlotArrays(store, "warm", kinds).write(rows, values)  # its sizing script loaded
    arrays = SlotArrays(store, "trips", kinds)
    assert trips.of(lambda: arrays.write(rows, values)) == 2  # chunks sized the first time
    assert trips.of(lambda: arrays.write(rows, values)) == 1
    assert trips.of(lambda: arrays.read(rows)) == 1
    registry = Registry(store)
    assert trips.of(lambda: registry.fill_state("r")) == 1


def test_owned_keys_share_the_namespace_slot_and_go_with_it(store: Store) -> None:
    a, b = store.owned_key("queue:a"), store.owned_key("stats")
    assert a == namespace_owned_key(store.namespace, "queue:a")
    config = next(k.key for k in scan_keys(store.r, store.namespace) if k.name == "config")
    assert key_slot(a.encode()) == key_slot(b.encode()) == key_slot(config)
    for name in ("", "config", "dead", "outcomes", "audit", "snapshots", "dict:task_id"):
        with pytest.raises(ValueError, match="store's key name"):
            store.owned_key(name)
    for name in ("rdict:x", "dpend:x", "done:b", "stage:b", "dl:x"):
        with pytest.raises(ValueError, match="store's key name"):
            namespace_owned_key(store.namespace, name)
    store.r.set(a, b"x")
    assert a.encode() in set(namespace_keys(store.r, store.namespace))
    assert store.namespace in list_namespaces(store.r)


def test_shard_counters_and_watermarks(store: Store) -> None:
    assert store.seqs() == [0, 0, 0] and store.watermarks() == [None, None, None]
    ids = _commit(store)
    seqs = store.seqs()
    assert sum(seqs) == len(ids)
    assert seqs == [int((ids[ids % 3 == s] // 3).max(initial=0)) for s in range(3)]
    with store.r.pipeline(transaction=False) as pipe:
        assert store.queue_seqs(pipe) == 3
        assert [int(v or 0) for v in pipe.execute()] == seqs
    store.set_watermark(1, 7)
    assert store.watermarks() == [None, 7, None]


def test_episode_names_by_shard_and_code(store: Store) -> None:
    steps = interleave(*(episode(e, LENGTH, "truncated") for e in range(EPISODES)))
    ids = store.commit(batch(steps), now=1000.0).ids
    shards, _ = _where(store, ids)
    committed = [f"ep{s['ep']}" for s in steps]
    codes = np.array([episode_code(n) for n in committed], np.int64)
    assert store.episode_names(shards, codes) == committed
    assert store.episode_names(np.array([0]), np.array([12345])) == [None]
    assert store.episode_names(np.zeros(0), np.zeros(0)) == []


def test_holding_says_which_slots_still_hold_their_steps(store: Store) -> None:
    ids = _commit(store)
    shards, slots = _where(store, ids)
    seqs = ids // 3
    assert store.holding(shards, slots, seqs).all()
    assert store.evict(ids[:5]) == 5
    held = store.holding(shards, slots, seqs)
    assert not held[:5].any() and held[5:].all()
    cap = store.config().cap
    assert not store.holding(shards[5:], slots[5:], seqs[5:] - cap).any()  # the ring came round


def test_info_and_dead_letters(store: Store) -> None:
    ids = _commit(store)
    shards, slots = _where(store, ids)
    step = store.get(ids, fields=[])["step_index"]
    stored = store.read_info(shards, slots)
    assert [s is not None for s in stored] == (step == 2).tolist()
    rows = np.flatnonzero(step == 2)
    assert [unpackb(stored[i]) for i in rows.tolist()] == [{"row": int(i)} for i in rows]
    assert store.dead_letters(10) == (0, [])
    limits, target = get_settings().limits, Target.of(store.namespace)
    for code in ("first", "second", "third"):
        finish(store.r, target, "rejected", limits, letter=Letter(code, f"why {code}"))
    total, newest = store.dead_letters(2)
    assert total == 3 and [f[b"reason"] for _, f in newest] == [b"why third", b"why second"]


def test_shards_of_a_batch_are_where_its_rows_are_committed(store: Store) -> None:
    b = batch(interleave(*(episode(e, 4) for e in range(EPISODES))))
    shards = store.shards_of(b)
    ids = store.commit(b, now=1.0).ids
    assert (shards == ids % 3).all()


def test_payload_spans_and_runs_read_what_get_reads(store: Store) -> None:
    ids = _commit(store)
    full = store.get(ids, fields=["obs", "action", "next_obs"])
    shards, slots = _where(store, ids)
    for shard in range(3):
        mine = shards == shard
        cap = store.config().cap
        span = read_fixed(store, shard, 0, cap, ["obs", "action"])
        assert span["obs"].shape == (cap, 4)
        assert (span["obs"][slots[mine]] == full["obs"][mine]).all()
        assert (span["action"][slots[mine]] == full["action"][mine]).all()
        seq_lo, n = 1, store.seqs()[shard]
        meta = read_meta_run(store, shard, seq_lo, n)
        assert (meta["id"] == np.arange(seq_lo, seq_lo + n) * 3 + shard).all()
        rows = np.arange(n)
        fields, next_obs, info = read_payload_run(store, shard, seq_lo, n, rows, meta["flags"])
        order = np.argsort(slots[mine])
        assert (fields["obs"] == full["obs"][mine][order]).all()
        explicit = np.flatnonzero(full["truncated"][mine][order])
        assert sorted(next_obs) == explicit.tolist()
        for i in explicit.tolist():
            assert (next_obs[i] == full["next_obs"][mine][order][i]).all()
        assert sorted(info) == np.flatnonzero(full["step_index"][mine][order] == 2).tolist()


def test_a_priority_pass_writes_only_what_nobody_changed(store: Store) -> None:
    ids = _commit(store)
    shard = 0
    mine = np.sort(ids[ids % 3 == shard])
    slots = (mine // 3 - 1) % store.config().cap
    store.update_priorities(mine, np.full(len(mine), 0.25, np.float32))  # a chunk to copy
    old = store.get(mine, fields=[])["priority"].astype(np.float32)
    snapshot_priorities(store)
    store.update_priorities(mine[:2], np.array([9.0, 9.0], np.float32))  # a trainer wins
    new = np.full(len(mine), 0.5, np.float32)
    assert write_priorities(store, shard, 0, slots, mine, old, new) == len(mine) - 2
    got = store.get(mine, fields=[])["priority"]
    assert (got[:2] == 9.0).all() and (got[2:] == 0.5).all()

    def snapshots() -> list[str]:
        return [k.name for k in scan_keys(store.r, store.namespace) if "psnap:" in k.name]

    assert snapshots()
    drop_priority_snapshots(store)
    assert snapshots() == []
    assert check_namespace(store.r, store.namespace).ok


def test_slot_arrays_round_trip(store: Store) -> None:
    cap = store.config().cap
    arrays = SlotArrays(store, "test", {"v": ("<f4", (3,)), "n": ("<i8", ())})
    rows = np.array([0, 1, 2, cap - 1, cap, 2 * cap + 5], np.int64)
    v = np.arange(18, dtype=np.float32).reshape(6, 3)
    n = np.arange(6, dtype=np.int64) + 100
    arrays.write(rows, {"v": v, "n": n})
    chunks = {(k.shard, k.name): k.key for k in scan_keys(store.r, store.namespace)}
    # Each chunk sized whole when first touched: a shard's slots fit one chunk here.
    assert store.r.strlen(chunks[(0, "vx:test:v:0")]) == cap * 3 * 4
    assert store.r.strlen(chunks[(2, "vx:test:n:0")]) == cap * 8
    assert (0, "vx:test:n:1") not in chunks
    got = arrays.read(rows)
    assert (got["v"] == v).all() and (got["n"] == n).all()
    assert (arrays.read(np.array([3]))["v"] == 0).all()  # unwritten: zeros
    whole = arrays.read_all(["n"])["n"]
    assert whole.shape == (3 * cap,) and (whole[rows] == n).all()
    assert check_namespace(store.r, store.namespace).ok  # the check knows slot arrays
    assert arrays.clear() > 0
    assert (arrays.read(rows)["n"] == 0).all()


def test_config_dictionaries_memory_and_the_check(store: Store) -> None:
    ids = _commit(store)
    with store.r.pipeline(transaction=False) as pipe:
        store.queue_config(pipe)
        (raw,) = pipe.execute()
    assert NamespaceConfig.from_bytes(raw, store.namespace).created == store.config().created
    store.commit(batch(episode(99, 2, task_id="gone")), now=1000.0)
    assert prune_column(store, "task_id", set(), now=0.0) == 0  # marked only, none swept
    dicts = {k.name: k.key for k in scan_keys(store.r, store.namespace) if k.shard is None}
    assert b"gone" in store.r.hgetall(dicts["dpend:task_id"])
    forward = dicts.get("dict:task_id")  # the forward map goes with its last entry
    assert forward is None or b"gone" not in store.r.hgetall(forward)
    keys = [k.key for k in scan_keys(store.r, store.namespace)]
    assert sum(key_bytes(store.r, keys)) > 0
    report = check_namespace(store.r, store.namespace)
    assert report.ok, report.problems
    assert len(store.get(ids, fields=[])["id"]) == len(ids)
    assert store.mark_dropped() == 1
    with pytest.raises(NamespaceError):
        Store(store.r, store.namespace).config()
    with pytest.raises(NamespaceDropped):  # the tombstone went with the config
        Store(store.r, store.namespace).revalidate()

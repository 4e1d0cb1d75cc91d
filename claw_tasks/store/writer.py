"""Writes: slot allocation, in-place payload writes, and the atomic per-shard commit that
makes a batch visible (or, redelivered, recognises it as already committed)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.connection.resp import setrange_many
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.schema import Schema
from claw_tasks.store.admin import Admin
from claw_tasks.store.commit import CommitPart, CommitResult
from claw_tasks.store.config import LOG_MAXLEN, MARKER_TTL, NamespaceError
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import payload_chunk_slots, row_episode_codes
from claw_tasks.store.replication import Replication, replicated
from claw_tasks.store.scripts import Scripts, execute


class Writer:
    """Commits batches; ``allocate`` + ``place`` let a client write large payloads first.
    A commit creates the namespace or adds the batch's tags through ``admin``."""

    def __init__(self, core: StoreCore) -> None:
        self.core, self.admin = core, Admin(core)

    def commit(
        self,
        batch: StepBatch,
        now: float | np.ndarray | None = None,
        dead_rows: Sequence[int] = (),
        replication: Replication | None = None,
    ) -> CommitResult:
        """Commit a validated batch: one atomic, idempotent Lua commit per shard part.

        ``now`` is the commit timestamp (per row when an array: a restore keeps the
        original ones). A batch with ``Placed`` fields (written in place after
        ``allocate``) lies in one shard; its ``dead_rows`` (rejected) are committed but
        never made alive. The result has the id of every row. A dropped namespace raises
        NamespaceDropped (it is not created again implicitly).

        ``replication``: each shard's part returns only once that many replicas of its
        master have it (``WAIT`` in the part's round trip), and so do the string codes the
        batch uses (in the dictionaries' round trip); NotReplicated otherwise, a transient
        error: the commit is idempotent, a redelivery waits again."""
        # Checked here, a few round trips before the scripts, whatever the caller checked
        # earlier: no script reads the tombstone (another hash slot), and a drop sweeps the
        # namespace's keys again only for a moment after leaving it
        # (orchestrator.maintenance.lifecycle.drop_namespace).
        self.core.revalidate()
        try:
            schema = self.admin.ensure_schema(batch.schema())  # no round trip once cached
        except NamespaceError:
            self.admin.create()
            schema = self.admin.ensure_schema(batch.schema())
        cfg = self.core.config()
        n = batch.n
        result = CommitResult(ids=np.full(n, -1, np.int64))
        if n == 0:
            return result
        now = time.time() if now is None else now
        str_cols = self._encode_str_columns(batch, schema, replication)
        ep_codes = row_episode_codes(batch.episode.values, batch.episode.index)
        shards = ep_codes % cfg.n_shards
        for shard in [0] if cfg.n_shards == 1 else np.unique(shards).tolist():
            rows = np.arange(n) if cfg.n_shards == 1 else np.flatnonzero(shards == shard)
            part = CommitPart(
                self.core, cfg, schema, batch, rows, int(shard), ep_codes, str_cols, now
            )
            seq0, state = self.allocate(int(shard), batch.batch_id, len(rows))
            part.run(seq0, state, list(dead_rows), result, replication)
        return result

    def _encode_str_columns(
        self, batch: StepBatch, schema: Schema, replication: Replication | None = None
    ) -> dict[str, np.ndarray]:
        """Per-row int32 codes of every string column (0 = missing); with
        ``replication``, known to be on that many replicas (the codes may have been added by
        another batch not yet replicated: adding 0 to a dictionary's counter replicates,
        so the WAIT after it covers them)."""
        names = [k for k, v in batch.strs.items() if v.values]
        script = Scripts.ALL["dict"]
        wait = replication is not None and replication.replicas > 0 and bool(names)

        def queue(pipe: Any) -> None:
            for k in names:
                keys = [
                    self.core.layout_keys.dict(k),
                    self.core.layout_keys.rdict(k),
                    self.core.layout_keys.dpend(k),
                ]
                script.queue(pipe, keys, batch.strs[k].values)
            if wait:
                pipe.hincrby(self.core.layout_keys.rdict(names[0]), "0", 0)

        if wait:
            replies = replicated(
                self.core.r,
                self.core.layout_keys.dict(names[0]),
                replication,  # type: ignore[arg-type]  # wait: not None
                queue,
                [script],
                what=f"string codes of batch {batch.batch_id}",
            )[:-1]
        else:
            replies = execute(self.core.r, [script], queue) if names else []
        out: dict[str, np.ndarray] = {}
        for k, codes in zip(names, replies, strict=True):
            vocab = np.concatenate([np.asarray(codes, np.int32), np.zeros(1, np.int32)])
            out[k] = vocab[batch.strs[k].index]  # index -1 picks the trailing 0
        return out

    def shards_of(self, batch: StepBatch) -> np.ndarray:
        """The shard each row of ``batch`` is committed to: its episode's (a code of its
        name modulo the shard count), so an episode's steps share a shard."""
        n_shards = self.core.config().n_shards
        return row_episode_codes(batch.episode.values, batch.episode.index) % n_shards

    def allocate(
        self, shard: int, batch_id: str, n: int, placed: Mapping[str, int] | None = None
    ) -> tuple[int, str]:
        """Take (idempotently, per batch id) ``n`` slots of a shard: returns ``(seq0,
        state)``. The older steps in those slots are evicted now, and the chunks of the
        ``placed`` fields (name -> row bytes) are sized for writing in place."""
        cfg = self.core.config()
        if n > cfg.cap:  # the ring would evict the shard's every step, then its own
            raise ValueError(
                f"batch {batch_id!r}: {n} slots > the {cfg.cap} a shard of "
                f"{self.core.namespace!r} holds: allocate at most {cfg.cap} per batch"
            )
        k = self.core.layout_keys
        args: list[Any] = [n, MARKER_TTL, k.shard(shard), cfg.cap, LOG_MAXLEN]
        for name, row_bytes in (placed or {}).items():
            args += [f"f:{name}", row_bytes, payload_chunk_slots(row_bytes)]
        seq0, state = self.core.scripts.alloc(
            keys=[
                k.shard_key(shard, f"b:{batch_id}"),
                k.shard_key(shard, "seq"),
                k.shard_key(shard, "log"),
                k.shard_key(shard, "alive"),
                k.shard_key(shard, "evictions"),
            ],
            args=args,
        )
        return int(seq0), state.decode() if isinstance(state, bytes) else state

    def place(self, shard: int, seq0: int, fields: Mapping[str, np.ndarray]) -> None:
        """Write fixed-shape payload rows into the slots of ``seq0..`` (after ``allocate``):
        one pipelined SETRANGE per chunk run, straight from the arrays' memory."""
        cfg = self.core.config()
        writes = []
        for name, arr in fields.items():
            arr = np.ascontiguousarray(arr)
            n, rb = len(arr), arr.nbytes // max(1, len(arr))
            raw = arr.data.cast("B") if arr.size else memoryview(b"")
            cs = payload_chunk_slots(rb)
            i = 0
            while i < n:
                slot = (seq0 - 1 + i) % cfg.cap
                run = min(n - i, cs - slot % cs, cfg.cap - slot)
                key = self.core.layout_keys.field(shard, name, slot // cs)
                writes.append((key, (slot % cs) * rb, raw[i * rb : (i + run) * rb]))
                i += run
        setrange_many(self.core.r, writes)

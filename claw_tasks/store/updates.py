"""Updates to stored steps' metadata (priorities, curation labels): one Lua script that
skips ids whose slot was reused since, so a late update never lands on a newer step."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.format.batch import tag_dtype
from claw_tasks.format.schema import tag_column
from claw_tasks.format.stepmeta import TERMINATED, UNTRAINABLE
from claw_tasks.store.config import LOG_MAXLEN
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import META_CHUNK_SLOTS, nan_xor
from claw_tasks.store.reader import Reader
from claw_tasks.store.scripts import Scripts, execute

AUDIT_MAXLEN = 100_000


class Updates:
    """Priorities and curation labels of live steps, by id; the audit stream. Uses the
    reader only to find an episode's steps (``curate(episode_id=...)``)."""

    def __init__(self, core: StoreCore) -> None:
        self.core, self.reader = core, Reader(core)

    def update_priorities(self, ids: Sequence[int] | np.ndarray, priorities: Any) -> int:
        """Set priorities of live steps; ids evicted or overwritten are skipped. Returns
        how many were updated."""
        pr = np.asarray(priorities, np.float32).reshape(-1)
        ids = np.asarray(ids, np.int64).reshape(-1)
        if len(pr) != len(ids):
            raise ValueError(f"{len(ids)} ids but {len(pr)} priorities")
        if not np.all(np.isfinite(pr)) or np.any(pr < 0):
            raise ValueError("priorities must be finite and >= 0")
        return self._update(ids, "priority", nan_xor(pr).tobytes(), 4, "set", "prio")

    def update_rewards(
        self,
        ids: Sequence[int] | np.ndarray,
        rewards: Any,
        *,
        tags: Mapping[str, float] | None = None,
        reward_source: str | None = None,
        terminated: Sequence[int] | np.ndarray = (),
    ) -> int:
        """Rewards that arrive after their steps were committed (LLM turns): ``reward``
        per id, numeric ``tags`` (same value on every id), ``reward_source``, and the
        terminated flag on the ids in ``terminated``. Logged like every update, so sampling
        indexes see them; terminated is written last, so a reader that sees a step
        terminated sees its rewards. Returns how many live steps got a reward."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        rw = np.asarray(rewards, np.float32).reshape(-1)
        if len(rw) != len(ids):
            raise ValueError(f"{len(ids)} ids but {len(rw)} rewards")
        if not np.all(np.isfinite(rw)):
            raise ValueError("rewards must be finite")
        done = self._update(ids, "reward", rw.tobytes(), 4, "set", "cur")
        if reward_source is not None:
            code = self.core.dicts.encode_strings("reward_source", [reward_source])
            codes = np.repeat(code, len(ids)).astype("<i4")
            self._update(ids, "reward_source", codes.tobytes(), 4, "set", "cur")
        for name, value in (tags or {}).items():
            vals = nan_xor(np.full(len(ids), _finite_tag(name, value), np.float64))
            self._update(ids, tag_column(name), vals.tobytes(), 8, "set", "cur")
        term = np.asarray(terminated, np.int64).reshape(-1)
        if len(term):
            self._update(term, "flags", bytes([TERMINATED]), 1, "bits_on", "cur")
        return done

    def curate(
        self,
        ids: Sequence[int] | np.ndarray | None = None,
        *,
        episode_id: str | None = None,
        quality: str | None = None,
        trainable: bool | None = None,
        tags: Mapping[str, str | float] | None = None,
        by: str | None = None,
    ) -> int:
        """Label steps (by id, or a whole episode): ``quality``, ``trainable`` and/or free
        ``tags`` (names the schema declares; a str tag takes a string, a num tag a number).
        Every label goes through the change log, so sampling indexes pick it up. ``by``
        (who) records the change in the audit stream. Returns how many live steps were
        labelled (evicted ids are skipped)."""
        if (ids is None) == (episode_id is None):
            raise ValueError("give either ids or episode_id")
        if quality is None and trainable is None and not tags:
            raise ValueError("give quality, trainable and/or tags")
        tag_values = self._tag_values(tags or {})
        if episode_id is not None:
            ids = self.reader.episode(episode_id, fields=[])["id"]
        ids = np.asarray(ids, np.int64).reshape(-1)
        done = 0
        for col, (raw, size) in tag_values.items():
            done = max(done, self._update(ids, col, raw * len(ids), size, "set", "cur"))
        if quality is not None:
            code = self.core.dicts.encode_strings("quality", [quality])
            done = self._update(
                ids, "quality", np.repeat(code, len(ids)).tobytes(), 4, "set", "cur"
            )
        if trainable is not None:
            mode = "bits_off" if trainable else "bits_on"
            done = max(done, self._update(ids, "flags", bytes([UNTRAINABLE]), 1, mode, "cur"))
        if by is not None:
            what: dict[str, Any] = {"steps": done}
            if episode_id is not None:
                what["episode"] = episode_id
            else:
                what["ids"] = ids[:1000].tolist()
            for k, v in (("quality", quality), ("trainable", trainable), ("tags", tags)):
                if v is not None:
                    what[k] = dict(v) if isinstance(v, Mapping) else v
            self.audit(by, "curate", what)
        return done

    def write_column(
        self, ids: np.ndarray, col: str, raw: bytes, size: int, *, op: str = "cur"
    ) -> int:
        """Write stored bytes (``size`` per id, the column's own encoding) to live steps'
        metadata column ``col``: what a rollback puts back, bit for bit. Logged as ``op``
        like every update; ids evicted or overwritten are skipped. Returns how many."""
        return self._update(np.asarray(ids, np.int64), col, raw, size, "set", op)

    def write_bits(self, ids: np.ndarray, mask: int, on: bool) -> int:
        """Turn the ``flags`` bits of ``mask`` on or off on live steps (logged)."""
        mode = "bits_on" if on else "bits_off"
        return self._update(np.asarray(ids, np.int64), "flags", bytes([mask]), 1, mode, "cur")

    def _tag_values(self, tags: Mapping[str, str | float]) -> dict[str, tuple[bytes, int]]:
        """Column -> (stored bytes of one value, item size), checked against the schema."""
        schema = self.core.config(refresh=True).schema
        declared = dict(schema.tags) if schema else {}
        out = {}
        for name, value in tags.items():
            kind = declared.get(name)
            if kind is None:
                known = ", ".join(sorted(declared)) or "none"
                raise ValueError(
                    f"tag {name!r} is not in the namespace schema (declared tags: {known}); "
                    "free tags are declared by the steps that first carry them"
                )
            col = tag_column(name)
            if kind == "str":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"tag {name!r} holds strings: give a non-empty string")
                out[col] = (self.core.dicts.encode_strings(col, [value]).astype("<i4").tobytes(), 4)
            else:
                num = _finite_tag(name, value)
                out[col] = (nan_xor(np.array([num], np.float64)).tobytes(), 8)
        return out

    def audit(self, who: str, action: str, what: Mapping[str, Any]) -> None:
        """Record a person's write (curation, a recipe edit) in the namespace's audit
        stream: who, when, what (JSON)."""
        self.core.r.xadd(
            self.core.layout_keys.audit,
            {
                "who": who,
                "at": f"{time.time():.3f}",
                "action": action,
                "what": json.dumps(what, sort_keys=True, default=str),
            },
            maxlen=AUDIT_MAXLEN,
            approximate=True,
        )

    def audit_log(self, count: int = 50) -> list[dict[str, Any]]:
        """The newest ``count`` audit entries, newest first."""
        out = []
        for entry_id, kv in self.core.r.xrevrange(self.core.layout_keys.audit, count=count):
            d = {k.decode(): v.decode() for k, v in kv.items()}
            out.append({"id": entry_id.decode(), **d, "what": json.loads(d.get("what", "{}"))})
        return out

    def _update(
        self, ids: np.ndarray, col: str, values: bytes, size: int, mode: str, op: str
    ) -> int:
        cfg = self.core.config()
        shards = ids % cfg.n_shards
        vals = np.frombuffer(values, np.uint8)
        calls = []
        for shard in np.unique(shards).tolist():
            sel = np.flatnonzero(shards == shard)
            part_vals = vals if mode != "set" else vals.reshape(-1, size)[sel]
            keys = [
                self.core.layout_keys.shard_key(shard, k)
                for k in ("log", "seq", "alive", "evicted")
            ]
            args = [
                self.core.layout_keys.shard(shard),
                cfg.cap,
                cfg.n_shards,
                shard,
                META_CHUNK_SLOTS,
                col,
                size,
                mode,
                ids[sel].tobytes(),
                part_vals.tobytes(),
                LOG_MAXLEN,
                op,
            ]
            calls.append((keys, args))
        if len(calls) == 1:  # the common case: one EVALSHA straight on the client
            return int(self.core.scripts.update(*calls[0]))
        script = Scripts.ALL["update"]  # several shards: one pipelined round trip
        replies = execute(
            self.core.r, [script], lambda p: [script.queue(p, k, a) for k, a in calls]
        )
        return sum(int(v) for v in replies)


def _finite_tag(name: str, value: Any) -> float:
    """A numeric tag's value, finite in the type it is used in (float32 for the rollout
    tags, :func:`~claw_tasks.format.batch.tag_dtype`): what ingest takes, on the paths
    that write tags of stored steps."""
    dtype = tag_dtype(name)
    try:
        num = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"tag {name!r} holds numbers: got {str(value)[:40]!r}") from None
    with np.errstate(over="ignore"):
        ok = bool(np.isfinite(np.asarray(num, dtype)))
    if not ok:
        kind = np.dtype(dtype).name
        raise ValueError(f"tag {name!r}: {num} is not a finite number as {kind}")
    return num

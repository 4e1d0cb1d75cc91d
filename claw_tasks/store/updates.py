"""Updates to stored steps' metadata (priorities, curation labels): one Lua script that
skips ids whose slot was reused since, so a late update never lands on a newer step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.schema import tag_column
from claw_tasks.store.config import LOG_MAXLEN
from claw_tasks.store.layout import META_CHUNK_SLOTS, TERMINATED, UNTRAINABLE, nan_xor
from claw_tasks.store.reader import Reader
from claw_tasks.store.scripts import Scripts, execute


class Updates(Reader):
    """Priorities and curation labels of live steps, by id."""

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
            code = self.encode_strings("reward_source", [reward_source])
            codes = np.repeat(code, len(ids)).astype("<i4")
            self._update(ids, "reward_source", codes.tobytes(), 4, "set", "cur")
        for name, value in (tags or {}).items():
            if not np.isfinite(value):
                raise ValueError(f"tag '{name}' must be finite, not {value}")
            vals = nan_xor(np.full(len(ids), value, np.float64))
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
    ) -> int:
        """Label steps (by id, or a whole episode): ``quality`` and/or ``trainable``.
        Returns how many live steps were labelled (evicted ids are skipped)."""
        if (ids is None) == (episode_id is None):
            raise ValueError("give either ids or episode_id")
        if quality is None and trainable is None:
            raise ValueError("give quality and/or trainable")
        if episode_id is not None:
            ids = self.episode(episode_id, fields=[])["id"]
        ids = np.asarray(ids, np.int64).reshape(-1)
        done = 0
        if quality is not None:
            code = self.encode_strings("quality", [quality])
            done = self._update(
                ids, "quality", np.repeat(code, len(ids)).tobytes(), 4, "set", "cur"
            )
        if trainable is not None:
            mode = "bits_off" if trainable else "bits_on"
            done = max(done, self._update(ids, "flags", bytes([UNTRAINABLE]), 1, mode, "cur"))
        return done

    def _update(
        self, ids: np.ndarray, col: str, values: bytes, size: int, mode: str, op: str
    ) -> int:
        cfg = self.config()
        shards = ids % cfg.n_shards
        vals = np.frombuffer(values, np.uint8)
        calls = []
        for shard in np.unique(shards).tolist():
            sel = np.flatnonzero(shards == shard)
            part_vals = vals if mode != "set" else vals.reshape(-1, size)[sel]
            keys = [self.keys.shard_key(shard, k) for k in ("log", "seq", "alive", "evicted")]
            args = [
                self.keys.shard(shard), cfg.cap, cfg.n_shards, shard, META_CHUNK_SLOTS, col,
                size, mode, ids[sel].tobytes(), part_vals.tobytes(), LOG_MAXLEN, op,
            ]  # fmt: skip
            calls.append((keys, args))
        if len(calls) == 1:  # the common case: one EVALSHA straight on the client
            return int(self.scripts.update(*calls[0]))
        script = Scripts.ALL["update"]  # several shards: one pipelined round trip
        replies = execute(self.r, [script], lambda p: [script.queue(p, k, a) for k, a in calls])
        return sum(int(v) for v in replies)

"""Steps and dead letters as log lines: what `claw inspect` and `claw dead` print."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from rich.text import Text

from claw_tasks.codecs import CodecError
from claw_tasks.format.arrays import unpackb
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.schema import SchemaError, key_tag
from claw_tasks.format.stepmeta import DICT_COLUMNS
from claw_tasks.store import Store
from orchestrator.cli.app import clipped

_PREVIEW_ITEMS = 6


def newest_ids(store: Store, limit: int) -> np.ndarray:
    """Ids of the `limit` newest live steps (by commit time, then id), oldest first."""
    ids, stamps = [], []
    for shard in range(store.config().n_shards):
        cols = store.meta_columns(shard, ["id", "timestamp"])
        alive = cols["alive"]
        ids.append(cols["id"][alive])
        stamps.append(cols["timestamp"][alive])
    all_ids, all_ts = np.concatenate(ids), np.concatenate(stamps)
    order = np.lexsort((all_ids, all_ts))
    return all_ids[order[-limit:]] if limit > 0 else all_ids[:0]


def parse_ids(text: str, option: str = "--ids") -> list[int]:
    """`"1,2, 3"` -> [1, 2, 3]; a clear ValueError naming ``option`` otherwise (step ids
    are int64: a larger number is refused here, not where it is converted)."""
    shown = clipped(text)
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} {shown!r}: give comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise ValueError(f"{option}: give at least one step id")
    if any(not -(2**63) <= i < 2**63 for i in ids):
        raise ValueError(f"{option} {shown!r}: a step id is an int64 (below 2**63)")
    return ids


def preview(value: Any) -> str:
    """`float32[4](0.01, -0.2, 0.03, 0.4)`; large arrays as min/mean/max."""
    a = np.asarray(value)
    return f"{describe(a)}({values(a)})"


def describe(a: np.ndarray) -> str:
    """`float32[84,84,3]`."""
    return f"{a.dtype.name}[{','.join(str(d) for d in a.shape)}]"


def values(value: Any, fmt: str = ".4g") -> str:
    """`0.01, -0.2, 0.03, 0.4`; large arrays as `min 0, mean 127.5, max 255`. Floats use
    `fmt`."""
    a = np.asarray(value)
    if a.size <= _PREVIEW_ITEMS:
        return ", ".join(_num(v, fmt) for v in a.ravel().tolist())
    if a.dtype.kind in "biuf":
        return f"min {_num(a.min(), fmt)}, mean {_num(a.mean(), fmt)}, max {_num(a.max(), fmt)}"
    return "…"


def _num(v: Any, fmt: str = ".4g") -> str:
    if isinstance(v, float | np.floating):
        return format(float(v), fmt)
    return str(v.item() if isinstance(v, np.generic) else v)


def _timestamp(ts: float) -> str:
    if not ts:
        return "-" * 23
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def step_lines(steps: dict[str, Any], fields: Sequence[str]) -> list[Text]:
    """One log line per step of a `Store.get` / `Store.episode` result.

    `next_obs` is shown only on the last step of an episode: elsewhere it is the next
    step's `obs`, which the next line shows.
    """
    lines = []
    for i in range(len(steps["id"])):
        line = Text.assemble(
            (_timestamp(float(steps["timestamp"][i])), "dim"),
            "  ",
            (f"#{int(steps['id'][i])}", "bold cyan"),
            "  ",
            (f"{steps['episode_id'][i]}:{int(steps['step_index'][i])}", "magenta"),
        )
        _meta(line, steps, i)
        for name in fields:
            ended = steps["terminated"][i] or steps["truncated"][i]
            if name == "next_obs" and not (ended and steps["has_next_obs"][i]):
                continue
            line.append(f"  {name}=", style="dim")
            line.append(preview(steps[name][i]))
        lines.append(line)
    return lines


def _meta(line: Text, steps: dict[str, Any], i: int) -> None:
    pairs: list[tuple[str, str]] = [(c, steps[c][i]) for c in DICT_COLUMNS if steps[c][i]]
    if steps["policy_version"][i]:
        pairs.append(("policy", str(int(steps["policy_version"][i]))))
    pairs.append(("reward", _num(steps["reward"][i])))
    if not math.isnan(steps["priority"][i]):
        pairs.append(("priority", _num(steps["priority"][i])))
    for key in (k for k in steps if key_tag(k) is not None):
        v = steps[key][i]
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            pairs.append((key, _num(v)))
    for key, value in pairs:
        line.append(f"  {key}=", style="dim")
        line.append(str(value), style="green" if key == "reward" else "")
    for flag, style in (("terminated", "bold red"), ("truncated", "bold yellow")):
        if steps[flag][i]:
            line.append(f"  {flag.upper()}", style=style)
    if not steps["trainable"][i]:
        line.append("  UNTRAINABLE", style="bold")


@dataclass
class DeadLetter:
    entry_id: str
    at: float
    batch_id: str
    reason: str
    rows: list[int] | None  # None: the whole batch
    steps: int | None  # steps in the dead payload, when it decodes
    payload_bytes: int

    @property
    def when(self) -> str:
        return _timestamp(self.at)

    @property
    def rows_text(self) -> str:
        if self.rows is None:
            return "whole batch"
        head = ", ".join(str(r) for r in self.rows[:10])
        return head + (f" (+{len(self.rows) - 10})" if len(self.rows) > 10 else "")


def dead_letters(store: Store, limit: int) -> tuple[int, list[DeadLetter]]:
    """(total dead letters, the newest `limit` of them, newest first)."""
    total, entries = store.dead_letters(limit)
    out = []
    for entry_id, fields in entries:
        payload = fields.get(b"payload")
        rows = unpackb(fields[b"rows"]) if b"rows" in fields else None
        out.append(
            DeadLetter(
                entry_id=entry_id.decode(),
                at=float(fields.get(b"at", b"0")),
                batch_id=fields.get(b"batch_id", b"?").decode(),
                reason=fields.get(b"reason", b"").decode(errors="replace"),
                rows=rows,
                steps=_steps_in(payload),
                payload_bytes=int(fields.get(b"payload_bytes", len(payload or b""))),
            )
        )
    return total, out


def _steps_in(payload: bytes | None) -> int | None:
    if not payload:
        return None
    try:
        return StepBatch.decode(payload).n
    except (CodecError, SchemaError):
        return None

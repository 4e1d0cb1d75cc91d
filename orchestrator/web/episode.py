"""The episode page: its steps (a page of them) with their labels, small fields and
``info``, its reward curve, an LLM episode's transcript and group, and the thumbnails of
image fields."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from claw_tasks.format.arrays import unpackb
from claw_tasks.format.schema import LLM_FIELDS, Schema, tag_column
from claw_tasks.format.stepmeta import episode_code
from claw_tasks.store import Store
from orchestrator.web import charts, thumbs, transcript
from orchestrator.web.access import Access, step_row

EPISODE_PAGE = 200
INFO_CHARS = 2000
SMALL_VECTOR = 16  # vector observations up to this many values are shown as numbers
DECODED = ("quality", "skill_tag", "task_id", "agent_id")


class EpisodeViews(Access):
    """``episode`` and ``thumbnail``."""

    # ---- episode -----------------------------------------------------------------------
    def episode(self, ns: str, name: str, page: int) -> dict[str, Any]:
        with self.lock(ns):
            q = self.query(ns)
            cols, cap, n_shards = q.index.columns, q.index.cap, q.index.n_shards
            code = episode_code(name)
            shard = code % n_shards
            part = slice(shard * cap, (shard + 1) * cap)
            rows = np.flatnonzero((cols["episode"][part] == code) & cols["alive"][part])
            rows = rows + shard * cap
            rows = rows[np.argsort(cols["step_index"][rows], kind="stable")]
            rewards = cols["reward"][rows].astype(np.float64)
            page = min(page, max(0, -(-len(rows) // EPISODE_PAGE) - 1))  # past the end: the last
            page_rows = rows[page * EPISODE_PAGE : (page + 1) * EPISODE_PAGE]
            meta = {k: v[page_rows] for k, v in cols.items()}  # copies: the index has them all
            group = (
                transcript.rollouts(cols, transcript.group_rows(cols, rows), code)
                if len(rows)
                else []
            )
            rows_of = np.array([g["row"] for g in group], np.int64)
            for g, gname in zip(group, self.episode_names(q, rows_of), strict=True):
                g["name"] = gname
        if not len(rows):
            raise KeyError(f"episode {name!r} has no stored steps in {ns!r}")
        store = q.store
        schema = store.config().schema
        assert schema is not None
        images, small, other = _field_kinds(schema)
        ids = meta["id"]
        shards, slots = page_rows // cap, page_rows % cap
        fields = store.read_fields(shards, slots, small) if small else {}
        infos = _infos(store, shards, slots)
        names = {c: store.decode_codes(c, meta[c].tolist()) for c in DECODED}
        tags = {}
        for tag, kind in (schema.tags or {}).items():
            col = meta[tag_column(tag)]
            tags[tag] = store.decode_codes(tag_column(tag), col.tolist()) if kind == "str" else col
        steps = [
            {
                **step_row(meta, i),
                "quality": names["quality"][i],
                "skill_tag": names["skill_tag"][i],
                "tags": {k: _plain(v[i]) for k, v in tags.items()},
                "fields": {f: _values(fields[f][i]) for f in small},
                "info": _info_text(infos[i]),
            }
            for i in range(len(ids))
        ]
        llm_view = None
        if transcript.is_llm(schema.fields):
            ragged = [f for f in (*LLM_FIELDS, "response_mask") if f in schema.fields]
            got = store.read_fields(shards, slots, ragged)
            llm_view = {"turns": transcript.turns(steps, infos, got), "group": group}
        return {
            "name": name,
            "steps": steps,
            "total": len(rows),
            "page": page,
            "llm": llm_view,
            "pages": max(1, -(-len(rows) // EPISODE_PAGE)),
            "task_id": names["task_id"][0] if len(ids) else None,
            "agent_id": names["agent_id"][0] if len(ids) else None,
            "curve": charts.polyline(rewards, width=640, height=120),
            "return": float(rewards.sum()),
            "images": images,
            "other": other,
        }

    def thumbnail(self, ns: str, step_id: int, fname: str) -> bytes:
        def make() -> bytes:
            store = self.store(ns)
            schema = store.config().schema
            spec = None if schema is None else schema.fields.get(fname)
            layout = (
                None if spec is None or spec.ragged else thumbs.image_layout(spec.dtype, spec.shape)
            )
            if spec is None or layout is None:
                raise thumbs.NotAnImage(f"field {fname!r} is not an image field of {ns!r}")
            thumbs.check_limits(tuple(int(d) for d in spec.shape), spec.row_bytes)
            arr = store.get([step_id], fields=[fname])[fname][0]
            return thumbs.to_png(arr, layout)

        return self.thumbs.get((ns, step_id, fname), make)


def _field_kinds(schema: Schema) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """The schema's fields shown as images, as numbers (small vectors), and by shape."""
    images, small, other = [], [], []
    for fname, spec in schema.fields.items():
        layout = None if spec.ragged else thumbs.image_layout(spec.dtype, spec.shape)
        if layout is not None:
            images.append(fname)
        elif not spec.ragged and spec.row_items <= SMALL_VECTOR:
            small.append(fname)
        else:
            other.append((fname, spec.describe()))
    return images, small, other


def _infos(store: Store, shards: np.ndarray, slots: np.ndarray) -> list[Any]:
    """Each step's ``info`` (None: none; untrusted: shown escaped, cut short)."""
    out = []
    for b in store.read_info(shards, slots):
        try:
            out.append(None if b is None else unpackb(b))
        except Exception as e:  # not ours to fail on: show why
            out.append(f"(unreadable info: {type(e).__name__})")
    return out


def _info_text(info: Any) -> str:
    if info is None:
        return ""
    text = info if isinstance(info, str) else json.dumps(info, default=str, ensure_ascii=False)
    return text if len(text) <= INFO_CHARS else text[:INFO_CHARS] + "…"


def _plain(v: Any) -> Any:
    if isinstance(v, np.floating):
        return None if np.isnan(v) else float(v)
    return v


def _values(a: Any) -> str:
    arr = np.asarray(a)
    if arr.ndim == 0:
        return f"{arr.item():.4g}" if arr.dtype.kind == "f" else str(arr.item())
    return ", ".join(f"{x:.3g}" if arr.dtype.kind == "f" else str(x) for x in arr.ravel())

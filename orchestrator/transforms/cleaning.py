"""A source's cleaning spec and what it does to a batch of its steps (numpy only).

A spec maps one source's representation to the target namespace's and says which steps
are bad. In order: ``rename`` (source field -> target field; fields not named keep their
names, ``drop`` removes some), ``fields`` (per target field: ``take`` reorders or selects
features of the last axis, ``scale`` and ``offset`` (``x * scale + offset``, e.g. a unit
change), ``one_hot: n`` turns a discrete action into n-way one-hot floats, ``argmax``
turns one-hot (or logits) into the discrete index, then ``dtype``), then the validity
``rules`` (each quarantines the steps it fails, by name: ``finite``, ``range: [lo, hi]``,
``shape``) and ``outliers`` (a z-score over the target namespace's running statistics of
the field, per feature, once they hold ``min_count`` steps). The rules read the mapped
values (the target's representation); a step failing several rules counts for each.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from orchestrator.transforms.running import RunningStats


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FieldMap(_Model):
    take: list[int] | None = None
    scale: float | list[float] | None = None
    offset: float | list[float] | None = None
    one_hot: PositiveInt | None = None
    argmax: bool = False
    dtype: str | None = None


class Rule(_Model):
    name: str
    field: str
    finite: bool = False
    range: tuple[float, float] | None = None
    shape: list[int] | None = None


class Outliers(_Model):
    field: str = "obs"
    z: PositiveFloat = 6.0
    min_count: PositiveInt = 1000


class CleanSpec(_Model):
    """One source's cleaning (docs/retrieval.md, "Cleaning")."""

    namespace: str = Field(description="the raw source namespace its steps are read from")
    rename: dict[str, str] = {}
    drop: list[str] = []
    fields: dict[str, FieldMap] = {}
    rules: list[Rule] = []
    outliers: list[Outliers] = []
    tags: dict[str, str] = {}
    """String tags every cleaned step of the source gets (``origin: noisy``)."""


def map_fields(spec: CleanSpec, fields: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The source's payload fields in the target representation."""
    out = {spec.rename.get(k, k): np.asarray(v) for k, v in fields.items() if k not in spec.drop}
    for name, fm in spec.fields.items():
        if name not in out:
            raise KeyError(f"fields.{name}: not a field after renaming ({sorted(out)})")
        x = out[name]
        if fm.argmax:
            x = np.argmax(x, axis=-1)
        if fm.one_hot is not None:
            idx = x.astype(np.int64).reshape(len(x))
            hot = np.zeros((len(x), fm.one_hot), np.float32)
            ok = (idx >= 0) & (idx < fm.one_hot)
            hot[np.flatnonzero(ok), idx[ok]] = 1.0
            hot[~ok] = np.nan  # out of range: no one-hot; a finite rule quarantines it
            x = hot
        if fm.take is not None:
            x = x[..., fm.take]
        if fm.scale is not None or fm.offset is not None:
            x = x.astype(np.float64) * np.asarray(fm.scale if fm.scale is not None else 1.0)
            x = x + np.asarray(fm.offset if fm.offset is not None else 0.0)
        if fm.dtype is not None:
            x = x.astype(fm.dtype)
        out[name] = np.ascontiguousarray(x)
    return out


def violations(
    spec: CleanSpec, fields: Mapping[str, np.ndarray], stats: Mapping[str, RunningStats]
) -> dict[str, np.ndarray]:
    """Per rule name, the steps that fail it (boolean masks); outliers are named
    ``outlier:<field>``. ``stats`` are the target's running statistics by field."""
    n = len(next(iter(fields.values())))
    out: dict[str, np.ndarray] = {}
    for rule in spec.rules:
        x = fields[rule.field]
        rows = x.reshape(n, -1)
        bad = np.zeros(n, bool)
        if rule.finite:
            bad |= ~np.isfinite(rows.astype(np.float64)).all(axis=1)
        if rule.range is not None:
            lo, hi = rule.range
            with np.errstate(invalid="ignore"):
                bad |= ((rows < lo) | (rows > hi)).any(axis=1)
        if rule.shape is not None and list(x.shape[1:]) != rule.shape:
            bad[:] = True
        out[rule.name] = bad
    for o in spec.outliers:
        st = stats.get(o.field)
        name = f"outlier:{o.field}"
        if st is None or st.count < o.min_count:
            out[name] = np.zeros(n, bool)
            continue
        rows = fields[o.field].reshape(n, -1).astype(np.float64)
        z = np.abs(rows - st.mean.reshape(-1)) / np.sqrt(np.maximum(st.var.reshape(-1), 1e-12))
        with np.errstate(invalid="ignore"):
            out[name] = (z > o.z).any(axis=1)
    return out


def bad_rows(found: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """Steps failing any rule."""
    bad = np.zeros(n, bool)
    for mask in found.values():
        bad |= mask
    return bad

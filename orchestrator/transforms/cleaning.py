"""A source's cleaning spec and what it does to a batch of its steps (numpy only).

A spec maps one source's representation to the target namespace's and says which steps
are bad. In order: ``rename`` (source field -> target field; fields not named keep their
names, ``drop`` removes some), ``fields`` (per target field: ``take`` reorders or selects
features of the last axis, ``scale`` and ``offset`` (``x * scale + offset``, e.g. a unit
change), ``one_hot: n`` turns a discrete action into n-way one-hot floats, ``argmax``
turns one-hot (or logits) into the discrete index, then ``dtype``), then the validity
``rules`` (each quarantines the steps it fails, by name: ``finite``, ``range: [lo, hi]``,
``shape``) and ``outliers`` (per feature, a z-score over the target namespace's running
mean and variance of the field, or Tukey's IQR fences over its running quartiles, once they
hold ``min_count`` steps). The rules read the mapped values (the target's
representation); a step failing several rules counts for each. ``dedup`` names what makes
two steps the same (:func:`step_digests`); the maintenance task keeps the digests.

:class:`RecipeClean` is the same mapping and rules declared in a recipe instead, applied
by the prefetch workers to every drawn batch (orchestrator/delivery/quarantine.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from orchestrator.transforms.quantiles import QuantileSample
from orchestrator.transforms.running import RunningStats

DIGEST_BYTES = 8
"""A step's dedup digest (blake2b): a collision among a million steps has odds ~1e-8."""


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
    """``z``: a feature more than ``z`` standard deviations from the running mean (the
    default, z 6); ``iqr``: a feature outside ``[q1 - iqr * IQR, q3 + iqr * IQR]`` of the
    running quartiles (Tukey: 1.5 "outside", 3 "far out"). Either, once the statistics
    hold ``min_count`` steps; two entries check both."""

    field: str = "obs"
    z: PositiveFloat | None = None
    iqr: PositiveFloat | None = None
    min_count: PositiveInt = 1000

    @model_validator(mode="after")
    def _one_test(self) -> Self:
        if self.z is not None and self.iqr is not None:
            raise ValueError("outliers: z or iqr in one entry (two entries check both)")
        if self.z is None and self.iqr is None:
            self.z = 6.0
        return self

    @property
    def rule(self) -> str:
        """The name it quarantines by: ``outlier:<field>`` (z) or ``iqr:<field>``."""
        return f"{'outlier' if self.iqr is None else 'iqr'}:{self.field}"


class Dedup(_Model):
    """Quarantine a step that repeats one brought in before, from any source: same
    ``fields`` (mapped; default every payload field), reward and ``terminated``."""

    fields: list[str] | None = None
    window: PositiveInt | None = None
    """Digests per generation: the newest ``window`` to ``2 * window`` are kept (default:
    the target's capacity: an older original has been evicted by the ring anyway)."""


class CleanSpec(_Model):
    """One source's cleaning (docs/retrieval.md, "Cleaning")."""

    namespace: str = Field(description="the raw source namespace its steps are read from")
    rename: dict[str, str] = {}
    drop: list[str] = []
    fields: dict[str, FieldMap] = {}
    rules: list[Rule] = []
    outliers: list[Outliers] = []
    dedup: Dedup | None = None
    tags: dict[str, str] = {}
    """String tags every cleaned step of the source gets (``origin: noisy``)."""


class RecipeClean(_Model):
    """A recipe's own cleaning (``clean:``): its fields' mapping, then rules and outliers
    checked on every drawn batch in the prefetch workers (a failing step is quarantined
    for the namespace and the batch drawn again). Outlier statistics are the recipe's:
    those of the rows it drew that passed."""

    fields: dict[str, FieldMap] = {}
    rules: list[Rule] = []
    outliers: list[Outliers] = []

    def names(self) -> set[str]:
        """Every field the section reads."""
        return {*self.fields, *(r.field for r in self.rules), *(o.field for o in self.outliers)}


def map_fields(
    spec: CleanSpec | RecipeClean, fields: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The source's payload fields in the target representation (a recipe's: its batch's
    fields as the recipe serves them)."""
    rename = spec.rename if isinstance(spec, CleanSpec) else {}
    drop = spec.drop if isinstance(spec, CleanSpec) else []
    out = {rename.get(k, k): np.asarray(v) for k, v in fields.items() if k not in drop}
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
    spec: CleanSpec | RecipeClean,
    fields: Mapping[str, np.ndarray],
    stats: Mapping[str, RunningStats],
    samples: Mapping[str, QuantileSample] | None = None,
) -> dict[str, np.ndarray]:
    """Per rule name, the steps that fail it (boolean masks); outliers are named by
    :attr:`Outliers.rule`. ``stats`` are the running statistics by field (z rules),
    ``samples`` the running quartiles' samples (iqr rules)."""
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
        out[o.rule] = out.get(o.rule, np.zeros(n, bool)) | _outliers(o, fields, stats, samples)
    return out


def _outliers(
    o: Outliers,
    fields: Mapping[str, np.ndarray],
    stats: Mapping[str, RunningStats],
    samples: Mapping[str, QuantileSample] | None,
) -> np.ndarray:
    x = fields[o.field]
    n = len(x)
    if o.iqr is not None:
        sample = (samples or {}).get(o.field)
        if sample is None or sample.count < o.min_count:
            return np.zeros(n, bool)
        return sample.outside(x, o.iqr)
    st = stats.get(o.field)
    if st is None or st.count < o.min_count:
        return np.zeros(n, bool)
    rows = x.reshape(n, -1).astype(np.float64)
    z = np.abs(rows - st.mean.reshape(-1)) / np.sqrt(np.maximum(st.var.reshape(-1), 1e-12))
    with np.errstate(invalid="ignore"):
        return (z > o.z).any(axis=1)


def step_digests(
    fields: Mapping[str, np.ndarray],
    names: Sequence[str],
    reward: np.ndarray,
    terminated: np.ndarray,
) -> list[bytes]:
    """Per step, a digest of fields ``names`` (their dtype, shape and bytes), its reward
    and ``terminated``: equal steps, equal digests."""
    n = len(reward)
    parts = [np.asarray(reward, "<f4").reshape(n, 1).view(np.uint8)]
    parts.append(np.asarray(terminated, np.uint8).reshape(n, 1))
    head = b""
    for name in sorted(names):
        x = np.ascontiguousarray(fields[name])
        head += f"{name}:{x.dtype.str}:{x.shape[1:]};".encode()
        parts.append(x.reshape(n, -1).view(np.uint8).reshape(n, -1))
    rows = np.concatenate(parts, axis=1)
    return [hashlib.blake2b(head + r.tobytes(), digest_size=DIGEST_BYTES).digest() for r in rows]


def bad_rows(found: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """Steps failing any rule."""
    bad = np.zeros(n, bool)
    for mask in found.values():
        bad |= mask
    return bad

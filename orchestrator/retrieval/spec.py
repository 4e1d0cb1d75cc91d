"""A vector index's definition (:class:`IndexSpec`) and the projection it names.

The projection turns a batch of a fixed-shape payload field into float32 vectors, in this
order: ``slice`` (a ``[start, stop, step]`` per leading axis of a row, ``null`` keeps an
axis whole), ``downscale`` (an image ``(H, W[, C])`` mean-pooled by an integer factor),
``feature`` (a ``"module:function"`` the workers' ``CLAW_FEATURES`` allowlist names:
whoever defines an index does not choose code for workers to import), flattening, then
``weights`` (a factor per feature, e.g. one over its standard deviation); ``cosine``
normalises each vector to unit length (searched by inner product).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
)

from orchestrator.recipe.base import Name

Feature = Callable[[np.ndarray, dict[str, Any]], np.ndarray]
METRICS = ("l2", "ip", "cosine")
TWO_LEVEL_FROM = 8192
"""From this many IVF lists on, k-means runs in two levels (orchestrator/retrieval/writer.py)."""
TRAIN_PER_LIST = {1: 39, 2: 10}
"""k-means samples per IVF list, by levels: faiss's minimum of 39 for one k-means over
every list (fewer cost recall: 10 per list at 4,096 lists lost 0.03 of recall@10 at
``nprobe`` 8), 10 for two levels (16,384 lists on 164k vectors, recall 0.99 at 16)."""
TRAIN_SHARE = 4
"""The default ``nlist`` trains once at most a quarter of the capacity holds vectors."""


class SpecError(ValueError):
    """An index definition that cannot be used; the message names the key."""


class IndexSpec(BaseModel):
    """One vector index of a namespace (docs/retrieval.md has every key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = "default"
    field: StrictStr = "obs"
    slice: list[list[int | None] | None] = []
    downscale: PositiveInt = 1
    feature: StrictStr | None = None
    params: dict[str, Any] = {}
    weights: list[float] | None = None
    """Per projected feature, a factor (e.g. 1 / its standard deviation: features of
    other units weigh alike in the distance)."""
    metric: Literal["l2", "ip", "cosine"] = "l2"
    kind: Literal["auto", "exact", "ivf"] = "auto"
    nlist: PositiveInt | None = None
    """IVF lists; default ``16 * sqrt(capacity)`` rounded to a power of two, 64..65536."""
    nprobe: PositiveInt | None = None
    """IVF lists a query scans (divided by the share of rows its ``where`` keeps); None:
    the writer calibrates it to ``recall`` against an exact search of a sample."""
    recall: float = Field(0.95, gt=0, le=1, strict=True)
    """The recall@10 the calibrated ``nprobe`` reaches on the stored vectors (checked as
    a lower confidence bound, orchestrator/retrieval/calibrate.py)."""
    quantizer: Literal["hnsw", "flat"] = "hnsw"
    """How a query finds its ``nprobe`` lists: ``hnsw``, an HNSW graph over the centroids
    (built by each reader from the stored centroids) from 2,048 lists on while ``nprobe``
    is below ``nlist / 64``, else a flat scan of every centroid
    (orchestrator/retrieval/coarse.py); ``flat``, the flat scan always."""
    quantizer_ef: PositiveInt = 16
    """The HNSW quantizer's ``efSearch`` (at least ``nprobe`` is used)."""
    codes: Literal["fp16", "float32"] = "fp16"
    """How a reader's IVF lists hold the vectors: ``fp16`` residual codes at a dimension
    that is a multiple of 8 (half the bytes a scan reads, ``k + 8`` candidates re-ranked
    exactly; float32 otherwise), or ``float32`` always (exact distances in the scan: a
    clump of near-duplicates far from its list's centroid is ranked by fp16 codes almost
    at random, docs/retrieval.md, "Limits")."""
    retrain: StrictBool = True
    """Train the quantizer again each time the vectors have doubled (within the capacity);
    each training makes every reading process reload its copy."""
    exact_below: int = Field(20_000, ge=0)
    """A query whose ``where`` leaves at most this many steps scans them exactly."""
    where: StrictStr | dict[str, Any] = {}
    """Which steps are indexed at all (the where language); others are never projected."""

    @field_validator("slice")
    @classmethod
    def _slices(cls, value: list[list[int | None] | None]) -> list[list[int | None] | None]:
        for i, s in enumerate(value):
            if s is not None and not 1 <= len(s) <= 3:
                raise ValueError(f"slice[{i}]: [start, stop] or [start, stop, step], got {s}")
            if s is not None and len(s) == 3 and s[2] == 0:
                raise ValueError(f"slice[{i}]: step 0")
        return value

    @field_validator("feature")
    @classmethod
    def _feature(cls, value: str | None) -> str | None:
        if value is not None and ":" not in value:
            raise ValueError(f"feature {value!r}: name it as 'module:function'")
        return value

    def lists(self, capacity: int) -> int:
        """IVF lists for a namespace of ``capacity`` steps: ``16 * sqrt(capacity)`` as a
        power of two in 64..65536, halved until training needs at most a quarter of the
        capacity. Many short lists (1M steps: 16,384 of ~61), which the HNSW quantizer
        finds cheaply, make a query scan few vectors (docs/benchmarks.md, "Retrieval")."""
        if self.nlist is not None:
            return self.nlist
        n = int(min(65536, max(64, 2 ** round(math.log2(16 * math.sqrt(max(capacity, 1)))))))
        while n > 64 and per_list(n) * n > capacity / TRAIN_SHARE:
            n //= 2
        return n

    def train_size(self, capacity: int) -> int:
        """Vectors the IVF quantizer is trained on (and must exist before it is):
        ``TRAIN_PER_LIST`` per list (below it an exact scan is used)."""
        n = self.lists(capacity)
        return per_list(n) * n


def per_list(nlist: int) -> int:
    """k-means samples per list for ``nlist`` lists."""
    return TRAIN_PER_LIST[2 if nlist >= TWO_LEVEL_FROM else 1]


def load_feature(name: str, allowed: tuple[str, ...]) -> Feature:
    """The feature function ``module:function``, if the workers' allowlist names it."""
    if name not in allowed:
        raise SpecError(
            f"feature {name!r} is not allowed here: add it to CLAW_FEATURES "
            f"(now {', '.join(allowed) or 'empty'})"
        )
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


class Projection:
    """``spec``'s projection of rows of a field of shape ``shape``: ``(n, *shape)`` in,
    float32 ``(n, dim)`` out."""

    def __init__(
        self, spec: IndexSpec, shape: tuple[int, ...], allowed: tuple[str, ...] = ()
    ) -> None:
        if len(spec.slice) > len(shape):
            raise SpecError(f"slice: {len(spec.slice)} axes for a field of shape {shape}")
        self.spec, self.shape = spec, tuple(shape)
        self.feature = None if spec.feature is None else load_feature(spec.feature, allowed)
        self.params = dict(spec.params)
        self.weights = None if spec.weights is None else np.asarray(spec.weights, np.float32)
        self.index = (slice(None), *(slice(None) if s is None else slice(*s) for s in spec.slice))
        if spec.downscale > 1 and len(shape) < 2:
            raise SpecError(f"downscale: needs an image (H, W[, C]), the field is {shape}")
        self.dim = int(self(np.zeros((1, *shape), np.float32)).shape[1])
        if self.dim == 0:
            raise SpecError(f"the projection of a field of shape {shape} is empty")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        spec = self.spec
        if x.shape[1:] != self.shape:
            raise SpecError(f"states of shape {x.shape[1:]}, the index's field is {self.shape}")
        n, x = len(x), x[self.index]
        if spec.downscale > 1:
            f = spec.downscale
            h, w = x.shape[1] // f * f, x.shape[2] // f * f
            x = x[:, :h, :w].astype(np.float32)
            x = x.reshape(n, h // f, f, w // f, f, *x.shape[3:]).mean(axis=(2, 4))
        if self.feature is not None:
            x = np.asarray(self.feature(x, self.params))
            if x.ndim < 1 or len(x) != n:
                raise SpecError(f"feature {spec.feature}: returned shape {x.shape}")
        out = np.array(x.reshape(n, -1), np.float32, order="C")  # a copy: never the caller's
        if self.weights is not None:
            if out.shape[1] != len(self.weights):
                raise SpecError(f"weights: {len(self.weights)} for {out.shape[1]} features")
            out *= self.weights
        if spec.metric == "cosine":
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            np.divide(out, norms, out=out, where=norms > 0)
        return out


def spec_of(raw: Mapping[str, Any] | IndexSpec) -> IndexSpec:
    """An :class:`IndexSpec` from its dict form (errors as :class:`SpecError`)."""
    if isinstance(raw, IndexSpec):
        return raw
    try:
        return IndexSpec.model_validate(dict(raw))
    except ValidationError as e:
        raise SpecError(f"vector index: {one_line(e)}") from None
    except ValueError as e:
        raise SpecError(f"vector index: {e}") from None


def one_line(e: ValidationError) -> str:
    """Each problem of ``e`` as ``key: message (got value)``, on one line."""
    problems = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "definition"
        got = repr(err.get("input"))
        got = got if len(got) <= 40 else got[:37] + "..."
        problems.append(f"{key}: {err['msg']} (got {got})")
    return "; ".join(problems)

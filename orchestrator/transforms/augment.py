"""Augmentation pipelines built from a recipe's ``augment`` section.

The section maps a field to a list of single-key ``{op: params}`` dicts (a bare op name means
default params), or to ``"same"``: ``next_obs: same`` applies the ``obs`` pipeline to
``next_obs`` with independent random draws (DrQ), sharing its running statistics::

    {"obs": [{"random_shift": {"pad": 4}}, {"color_jitter": {"brightness": 0.2, "p": 0.8}}],
     "next_obs": "same"}

Image ops take NHWC ``uint8`` batches (any leading axes are batch axes). Every op draws from
the ``numpy.random.Generator`` it is given, so a plan is reproducible from a seed, and no op
writes into its input: stored data stays untouched.

Both image ops beat albumentations 2.0.8 per-image loops on one core (``bench/augment.py``),
so neither calls it: ``random_shift`` copies each image once, the part its window overlaps
edge-replicated by ``cv2.copyMakeBorder`` (no padded batch), ``color_jitter`` computes all
random factors vectorized and applies fused per-image colour matrices with OpenCV, the
library albumentations itself calls (~1.8x with hue, 2.5-6x without).

:meth:`AugmentPlan.out_specs` tells the augmented fields' dtypes and shapes before the
plan runs, and :meth:`AugmentPlan.apply` can write them into given arrays (``out``): the
prefetch worker augments straight into the shared-memory segment a batch goes out in.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from claw_tasks.settings import get_settings
from orchestrator.transforms.base import Op
from orchestrator.transforms.features import GaussianNoise, Normalize
from orchestrator.transforms.image import ColorJitter, RandomShift
from orchestrator.transforms.running import LocalStats, RunningNormalize, RunningStats, StatsStore

__all__ = [
    "OPS",
    "SAME",
    "AugmentPlan",
    "ColorJitter",
    "GaussianNoise",
    "LocalStats",
    "Normalize",
    "Op",
    "Pipeline",
    "RandomShift",
    "RunningNormalize",
    "RunningStats",
    "StatsStore",
    "augment_rng",
    "build_pipelines",
]

SAME = "same"

OPS: dict[str, type[Op]] = {
    op.name: op for op in (RandomShift, ColorJitter, Normalize, GaussianNoise, RunningNormalize)
}


def augment_rng(seed: int) -> np.random.Generator:
    """The random stream one batch's augmentation draws from: every op (albumentations
    too, seeded from it) draws from this one, so the seed alone gives the batch's
    augmentation again (``claw replay``)."""
    return np.random.default_rng(seed)


class Pipeline:
    """The ops of one field, applied in order."""

    def __init__(self, ops: list[Op]) -> None:
        self.ops = ops

    def apply(
        self,
        x: np.ndarray,
        rng: np.random.Generator,
        *,
        observe: bool,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Transform ``x``; ``observe`` lets stateful ops update from the data first. With
        ``out`` (of :meth:`out_spec`'s dtype and shape) the result is written there: by the
        last op itself when it ``writes_out``, else copied."""
        for i, op in enumerate(self.ops):
            try:
                if observe:
                    op.observe(x)
                last = out is not None and i == len(self.ops) - 1
                x = op(x, rng, out=out) if last and op.writes_out else op(x, rng)  # type: ignore[call-arg]  # out= only when the op says it writes_out
            except ValueError as exc:
                raise ValueError(f"{op.name}: {exc}") from exc
        if out is not None and x is not out:
            if x.dtype != out.dtype or x.shape != out.shape:
                raise ValueError(f"result {x.dtype}{x.shape} != laid out {out.dtype}{out.shape}")
            np.copyto(out, x)
            return out
        return x

    def out_spec(
        self, dtype: np.dtype, shape: tuple[int, ...]
    ) -> tuple[np.dtype, tuple[int, ...]] | None:
        """The result's dtype and shape for an input of ``dtype`` and ``shape``; None when
        an op does not tell it before running."""
        spec: tuple[np.dtype, tuple[int, ...]] | None = (np.dtype(dtype), tuple(shape))
        for op in self.ops:
            spec = op.out_spec(*spec) if spec is not None else None
        return spec

    def running_ops(self) -> dict[int, RunningNormalize]:
        """The pipeline's stateful ops, by op index."""
        return {i: op for i, op in enumerate(self.ops) if isinstance(op, RunningNormalize)}


class AugmentPlan:
    """Per-field pipelines of a recipe; ``aliases`` maps a field to the field whose pipeline
    it shares (``next_obs: same``)."""

    def __init__(self, pipelines: dict[str, Pipeline], aliases: dict[str, str]) -> None:
        self.pipelines = pipelines
        self.aliases = aliases

    @property
    def fields(self) -> list[str]:
        """Fields this plan transforms."""
        return [*self.pipelines, *self.aliases]

    def apply(
        self,
        batch: Mapping[str, np.ndarray],
        rng: np.random.Generator,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """A new dict with the augmented fields; other fields pass through, inputs untouched.
        ``out`` maps every augmented field to the array its result is written into (laid
        out from :meth:`out_specs`); the same draws give the same results either way.

        Owned fields go first (stateful ops observe them), then aliases, which use the same
        ops and the same, already updated statistics, with their own random draws.
        """
        res = dict(batch)
        owned = [(f, f, True) for f in self.pipelines]
        for field, owner, observe in owned + [(f, o, False) for f, o in self.aliases.items()]:
            if field not in batch:
                raise ValueError(f"augment: batch has no field {field!r}")
            try:
                x, dst = np.asarray(batch[field]), None if out is None else out[field]
                res[field] = self.pipelines[owner].apply(x, rng, observe=observe, out=dst)
            except ValueError as exc:
                raise ValueError(f"augment {field!r}: {exc}") from exc
        return res

    def out_specs(
        self, batch: Mapping[str, Any]
    ) -> dict[str, tuple[np.dtype, tuple[int, ...]]] | None:
        """The augmented fields' dtypes and shapes for ``batch``, before the plan runs; None
        when one of them is not a numeric array or an op does not tell."""
        specs = {}
        for field in self.fields:
            x = batch.get(field)
            owner = self.aliases.get(field, field)
            if not isinstance(x, np.ndarray) or x.dtype.hasobject:
                return None
            spec = self.pipelines[owner].out_spec(x.dtype, x.shape)
            if spec is None:
                return None
            specs[field] = spec
        return specs

    def stats_versions(self) -> dict[str, int]:
        """Per field normalised by the namespace's statistics: their version (count) the
        last batch used."""
        return {
            f: op.stats.count
            for f, p in self.pipelines.items()
            for op in p.running_ops().values()
            if op.scope == "namespace"
        }

    def state_dict(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Running statistics as ``{field: {op index: state}}`` of plain dicts and lists."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for f, p in self.pipelines.items():
            ops = {str(i): op.store.get(op.key).state_dict() for i, op in p.running_ops().items()}
            if ops:
                out[f] = ops
        return out

    def load_state_dict(self, state: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
        """Restore :meth:`state_dict` output into the plan's stats store."""
        for field, ops in state.items():
            running = self.pipelines[field].running_ops() if field in self.pipelines else {}
            for index, op_state in ops.items():
                if int(index) not in running:
                    raise ValueError(f"augment state: no running_normalize at {field}[{index}]")
                op = running[int(index)]
                op.stats = RunningStats.from_state_dict(op_state)
                op.store.put(op.key, op.stats)


def _build_op(entry: Any) -> Op:
    if isinstance(entry, str):
        name, params = entry, {}
    elif isinstance(entry, Mapping) and len(entry) == 1:
        name, params = next(iter(entry.items()))
        params = {} if params is None else params
    else:
        raise ValueError(f"expected {{op: params}} or an op name, got {entry!r}")
    if name == "albumentations":  # imported here: albumentations is a heavy import
        from orchestrator.transforms.albu import Albumentations

        return Albumentations(params, get_settings().albumentations)
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known: {sorted(OPS)} and 'albumentations'")
    if not isinstance(params, Mapping):
        raise ValueError(f"{name}: params must be a mapping, got {params!r}")
    sig = inspect.signature(OPS[name])
    unknown = set(params) - set(sig.parameters)
    missing = [k for k, p in sig.parameters.items() if p.default is p.empty and k not in params]
    if unknown:
        raise ValueError(
            f"{name}: unknown params {sorted(unknown)}; accepted {list(sig.parameters)}"
        )
    if missing:
        raise ValueError(f"{name}: missing required params {missing}")
    try:
        return OPS[name](**params)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


def build_pipelines(
    spec: Mapping[str, Any] | None,
    *,
    stats: StatsStore | None = None,
    namespace_stats: StatsStore | None = None,
) -> AugmentPlan:
    """Build an :class:`AugmentPlan` from a recipe's ``augment`` section; its running
    statistics live in ``stats`` (default: this process, :class:`LocalStats`), those of
    ``scope: namespace`` ops in ``namespace_stats`` under the field's name.

    Raises ``ValueError`` naming the field and op on an unknown op or bad params.
    """
    stats = LocalStats() if stats is None else stats
    pipelines: dict[str, Pipeline] = {}
    aliases: dict[str, str] = {}
    for field, entries in (spec or {}).items():
        if entries == SAME:
            source = field.removeprefix("next_")
            if source == field or not isinstance((spec or {}).get(source), list):
                raise ValueError(
                    f"augment {field!r}: 'same' needs a next_<field> whose <field> has a pipeline"
                )
            aliases[field] = source
            continue
        if not isinstance(entries, list):
            raise ValueError(f"augment {field!r}: expected a list of ops or 'same'")
        ops = []
        for i, entry in enumerate(entries):
            try:
                ops.append(_build_op(entry))
            except ValueError as exc:
                raise ValueError(f"augment {field!r} op #{i}: {exc}") from exc
        pipelines[field] = Pipeline(ops)
        for i, op in pipelines[field].running_ops().items():
            op.store, op.key = stats, f"{field}/{i}"
            if op.scope == "namespace":
                op.store, op.key = namespace_stats or LocalStats(), field
    return AugmentPlan(pipelines, aliases)

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
so neither calls it: ``random_shift`` is one gather from a ``sliding_window_view`` of the
edge-padded batch (~2.6x), ``color_jitter`` computes all random factors vectorized and
applies fused per-image colour matrices with OpenCV, the library albumentations itself calls
(~1.8x with hue, 2.5-6x without).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import cv2
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from claw_tasks.settings import load_settings

SAME = "same"

# RGB -> gray weights of OpenCV (and so of albumentations).
_LUMA = np.array([0.299, 0.587, 0.114])


def _number(key: str, value: Any, lo: float, hi: float = np.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"{key} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def _range(key: str, value: Any, center: float, lo: float, hi: float) -> tuple[float, float]:
    """A jitter range: ``v`` means ``[center - v, center + v]`` (low end clamped to ``lo``), a
    ``[low, high]`` pair is taken as is."""
    if isinstance(value, list | tuple) and len(value) == 2:
        a, b = (_number(key, v, lo, hi) for v in value)
        if a > b:
            raise ValueError(f"{key} range must be [low, high], got {list(value)}")
        return a, b
    v = _number(key, value, 0.0, hi - center)
    return max(lo, center - v), center + v


def _vector(key: str, value: Any) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float32)
    if arr.ndim > 1 or arr.size == 0 or not np.isfinite(arr).all():
        raise ValueError(f"{key} must be a finite number or list of numbers, got {value!r}")
    return arr


def _images(x: np.ndarray) -> np.ndarray:
    if x.ndim < 4:
        raise ValueError(f"expects NHWC images (ndim >= 4), got shape {x.shape}")
    return x.reshape(-1, *x.shape[-3:])


def _rows(x: np.ndarray) -> np.ndarray:
    """Samples as rows: features are the last axis (a 1-d field has scalar features)."""
    return x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(-1)


class Op:
    """One augmentation step. Subclasses validate their params in ``__init__``."""

    name: ClassVar[str]

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Return the transformed copy of ``x``."""
        raise NotImplementedError

    def observe(self, x: np.ndarray) -> None:
        """Update state from the data about to be transformed (stateful ops only)."""


class RandomShift(Op):
    """DrQ random shift: replicate-pad by ``pad`` pixels, then crop back at a random offset."""

    name = "random_shift"

    def __init__(self, pad: int = 4, p: float = 1.0) -> None:
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise ValueError(f"pad must be a non-negative integer, got {pad!r}")
        self.pad = pad
        self.p = _number("p", p, 0.0, 1.0)

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        imgs, pad = _images(x), self.pad
        n, h, w, c = imgs.shape
        dy = rng.integers(0, 2 * pad + 1, n)
        dx = rng.integers(0, 2 * pad + 1, n)
        if self.p < 1.0:
            skip = rng.random(n) >= self.p
            dy[skip] = dx[skip] = pad
        padded = np.empty((n, h + 2 * pad, w + 2 * pad, c), imgs.dtype)
        padded[:, pad : pad + h, pad : pad + w] = imgs
        padded[:, pad : pad + h, :pad] = imgs[:, :, :1]
        padded[:, pad : pad + h, pad + w :] = imgs[:, :, -1:]
        padded[:, :pad] = padded[:, pad : pad + 1]
        padded[:, pad + h :] = padded[:, pad + h - 1 : pad + h]
        # Rows of (W + 2 pad) * C bytes: a shift of dx pixels is an offset of dx * C bytes, so
        # each output image is one contiguous-row window of the padded image.
        rows = padded.reshape(n, h + 2 * pad, (w + 2 * pad) * c)
        windows = sliding_window_view(rows, (h, w * c), axis=(1, 2))
        return windows[np.arange(n), dy, dx * c].reshape(x.shape)


class ColorJitter(Op):
    """Brightness, contrast, saturation and hue jitter of RGB (or gray) uint8 images, with the
    semantics of albumentations' ``ColorJitter`` (torchvision formulas, OpenCV HSV hue).

    A number ``v`` draws brightness/contrast/saturation factors from ``[max(0, 1 - v), 1 + v]``
    and the hue shift from ``[-v, v]`` (fraction of a turn, ``v <= 0.5``); a ``[low, high]``
    pair is used as is. Unlike albumentations, an omitted component is off (torchvision's
    default) and ``p`` (per image) defaults to 1. Each image gets its own random order of the
    four steps; brightness, contrast and saturation are linear and commute, so the ones before
    the hue step and the ones after it are each fused into one affine colour transform
    (``cv2.transform``), rounded and clipped once instead of after every step.
    """

    name = "color_jitter"

    def __init__(
        self,
        brightness: float | list[float] = 0.0,
        contrast: float | list[float] = 0.0,
        saturation: float | list[float] = 0.0,
        hue: float | list[float] = 0.0,
        p: float = 1.0,
    ) -> None:
        self.brightness = _range("brightness", brightness, 1.0, 0.0, np.inf)
        self.contrast = _range("contrast", contrast, 1.0, 0.0, np.inf)
        self.saturation = _range("saturation", saturation, 1.0, 0.0, np.inf)
        self.hue = _range("hue", hue, 0.0, -0.5, 0.5)
        self.p = _number("p", p, 0.0, 1.0)

    @staticmethod
    def _affine(bright: np.ndarray, contrast: np.ndarray, sat: np.ndarray, c: int) -> np.ndarray:
        """Per-image ``C x (C + 1)`` matrices of brightness . contrast . saturation, with the
        last column holding the contrast offset per unit of mean gray (filled in by callers).

        contrast(x) = k x + (1 - k) mean_gray(x); brightness scales both terms and saturation
        keeps gray levels, so the three commute.
        """
        n = len(bright)
        mats = np.zeros((n, c, c + 1))
        gray = np.outer(np.ones(3), _LUMA) if c == 3 else np.eye(1)
        lin = sat[:, None, None] * np.eye(c) + (1 - sat)[:, None, None] * gray
        mats[:, :, :c] = (bright * contrast)[:, None, None] * lin
        mats[:, :, c] = (bright * (1 - contrast))[:, None]
        return mats

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        imgs = np.ascontiguousarray(_images(x))
        if imgs.dtype != np.uint8 or imgs.shape[-1] not in (1, 3):
            raise ValueError(f"expects uint8 images with 1 or 3 channels, got {x.dtype}{x.shape}")
        n, c = len(imgs), imgs.shape[-1]
        apply = rng.random(n) < self.p
        ranges = (self.brightness, self.contrast, self.saturation, self.hue)
        factors = np.stack([rng.uniform(lo, hi, n) for lo, hi in ranges])
        keys = rng.random((4, n))
        with_hue = c == 3 and self.hue != (0.0, 0.0)
        # Step j of brightness/contrast/saturation runs before hue iff its key is smaller.
        before = keys[:3] < keys[3] if with_hue else np.ones((3, n), bool)
        pre = self._affine(*np.where(before, factors[:3], 1.0), c)
        post = self._affine(*np.where(before, 1.0, factors[:3]), c)
        luma = _LUMA if c == 3 else np.ones(1)
        if self.contrast != (1.0, 1.0):
            pre[:, :, c] *= (np.array([cv2.mean(im)[:c] for im in imgs]) @ luma)[:, None]
        else:
            pre[:, :, c] = 0.0
        # OpenCV uint8 hue is in [0, 180): albumentations' lookup table, one per image.
        hue_luts = np.mod(np.arange(256) + 180 * factors[3][:, None], 180).astype(np.uint8)
        post_contrast = self.contrast != (1.0, 1.0) and not before[1].all()

        out = np.empty_like(imgs) if apply.all() else imgs.copy()
        for i in np.flatnonzero(apply):
            if not with_hue:
                cv2.transform(imgs[i], pre[i], dst=out[i])
                continue
            y = cv2.cvtColor(cv2.transform(imgs[i], pre[i]), cv2.COLOR_RGB2HSV)
            y[..., 0] = cv2.LUT(y[..., 0], hue_luts[i])
            y = cv2.cvtColor(y, cv2.COLOR_HSV2RGB)
            post[i, :, c] *= cv2.mean(y)[:c] @ luma if post_contrast else 0.0
            cv2.transform(y, post[i], dst=out[i])
        return out.reshape(x.shape)


class Normalize(Op):
    """``(x / scale - mean) / std`` as float32; mean/std are numbers or per-last-axis lists."""

    name = "normalize"

    def __init__(
        self, mean: float | list[float] = 0.0, std: float | list[float] = 1.0, scale: float = 1.0
    ) -> None:
        self.mean, self.std = _vector("mean", mean), _vector("std", std)
        if (self.std <= 0).any():
            raise ValueError(f"std must be > 0, got {std!r}")
        scale = _number("scale", scale, 0.0)
        if scale == 0:
            raise ValueError("scale must be > 0")
        self._mul = (1.0 / (scale * self.std)).astype(np.float32)
        self._add = (-self.mean / self.std).astype(np.float32)

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        for arr in (self._mul, self._add):
            if arr.size > 1 and (x.ndim == 0 or x.shape[-1] != arr.size):
                raise ValueError(f"{arr.size} mean/std values for last axis of shape {x.shape}")
        out = x.astype(np.float32)
        out *= self._mul
        out += self._add
        return out


class GaussianNoise(Op):
    """Add ``N(0, std^2)`` noise to each row with probability ``p``; float64 stays float64,
    anything else becomes float32."""

    name = "gaussian_noise"

    def __init__(self, std: float, p: float = 1.0) -> None:
        self.std = _number("std", std, 0.0)
        self.p = _number("p", p, 0.0, 1.0)

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        dtype = np.float64 if x.dtype == np.float64 else np.float32
        out = x.astype(dtype)
        noise = rng.standard_normal(x.shape, dtype=dtype)
        noise *= dtype(self.std)
        if self.p < 1.0:
            noise *= (rng.random(x.shape[0]) < self.p).reshape(-1, *[1] * (x.ndim - 1))
        out += noise
        return out


class RunningStats:
    """Count, mean and variance of feature vectors, merged batch by batch (Chan et al.)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = np.zeros(())
        self.m2 = np.zeros(())

    @classmethod
    def of(cls, rows: np.ndarray) -> RunningStats:
        """The statistics of a batch of rows (first axis: samples)."""
        st = cls()
        st.update(rows)
        return st

    @property
    def var(self) -> np.ndarray:
        """Population variance (1 before any data)."""
        return self.m2 / self.count if self.count else np.ones_like(self.m2)

    def merge(self, count: int, mean: np.ndarray, m2: np.ndarray) -> None:
        """Fold in the stats of another set of rows (sum of squared deviations ``m2``)."""
        if not count:
            return
        if self.count and self.mean.shape != np.shape(mean):
            raise ValueError(f"feature shape {np.shape(mean)} != running shape {self.mean.shape}")
        total = self.count + count
        delta = mean - self.mean if self.count else np.asarray(mean, dtype=np.float64)
        self.mean = self.mean + delta * (count / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * count / total)
        self.count = total

    def update(self, rows: np.ndarray) -> None:
        """Fold in a batch of rows (first axis: samples)."""
        if not len(rows):
            return
        x = rows.astype(np.float64)
        mean = x.mean(axis=0)
        self.merge(len(x), mean, ((x - mean) ** 2).sum(axis=0))

    def state_dict(self) -> dict[str, Any]:
        """Plain dict of numbers and lists (JSON/msgpack-able)."""
        return {
            "count": self.count,
            "shape": list(self.mean.shape),
            "mean": self.mean.ravel().tolist(),
            "var": np.broadcast_to(self.var, self.mean.shape).ravel().tolist(),
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RunningStats:
        """Restore from :meth:`state_dict` output."""
        st, shape = cls(), tuple(state["shape"])
        st.count = int(state["count"])
        st.mean = np.asarray(state["mean"], dtype=np.float64).reshape(shape)
        st.m2 = np.asarray(state["var"], dtype=np.float64).reshape(shape) * st.count
        return st


class StatsStore(Protocol):
    """Where the running statistics of a plan live, by key (``<field>/<op index>``).

    ``merge`` folds a batch's statistics into the stored ones and returns the result as one
    atomic step, so processes sharing a store (prefetch workers of one recipe, a restarted
    worker) normalise with the same statistics. The prefetch workers keep them in Redis
    (:mod:`orchestrator.delivery.augstats`); :class:`LocalStats` keeps them in this process.
    """

    def merge(self, key: str, batch: RunningStats) -> RunningStats: ...

    def get(self, key: str) -> RunningStats: ...

    def put(self, key: str, stats: RunningStats) -> None: ...


class LocalStats:
    """A :class:`StatsStore` in this process's memory."""

    def __init__(self) -> None:
        self._stats: dict[str, RunningStats] = {}

    def merge(self, key: str, batch: RunningStats) -> RunningStats:
        st = self._stats.setdefault(key, RunningStats())
        st.merge(batch.count, batch.mean, batch.m2)
        return st

    def get(self, key: str) -> RunningStats:
        return self._stats.get(key) or RunningStats()

    def put(self, key: str, stats: RunningStats) -> None:
        self._stats[key] = stats


class RunningNormalize(Op):
    """Normalize by running mean/variance of the data seen so far (per last-axis feature);
    float32 out, optionally clipped to ``[-clip, clip]``. ``update: false`` freezes the stats.

    The statistics live in the plan's :class:`StatsStore` under ``key`` (set by
    :func:`build_pipelines`); ``stats`` is the snapshot the last batch was normalised with.
    """

    name = "running_normalize"

    def __init__(self, clip: float | None = None, eps: float = 1e-8, update: bool = True) -> None:
        self.clip = None if clip is None else _number("clip", clip, 0.0)
        self.eps = _number("eps", eps, 0.0)
        if not isinstance(update, bool):
            raise ValueError(f"update must be true or false, got {update!r}")
        self.update = update
        self.store: StatsStore = LocalStats()
        self.key = self.name
        self.stats = RunningStats()

    def observe(self, x: np.ndarray) -> None:
        if self.update:
            self.stats = self.store.merge(self.key, RunningStats.of(_rows(x)))
        else:
            self.stats = self.store.get(self.key)

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        st = self.stats
        if st.count and st.mean.shape != _rows(x).shape[1:]:
            raise ValueError(f"feature shape {_rows(x).shape[1:]} != running {st.mean.shape}")
        out = x.astype(np.float32)
        out -= st.mean.astype(np.float32)
        out *= (1.0 / np.sqrt(st.var + self.eps)).astype(np.float32)
        if self.clip is not None:
            np.clip(out, -self.clip, self.clip, out=out)
        return out


OPS: dict[str, type[Op]] = {
    op.name: op for op in (RandomShift, ColorJitter, Normalize, GaussianNoise, RunningNormalize)
}


class Pipeline:
    """The ops of one field, applied in order."""

    def __init__(self, ops: list[Op]) -> None:
        self.ops = ops

    def apply(self, x: np.ndarray, rng: np.random.Generator, *, observe: bool) -> np.ndarray:
        """Transform ``x``; ``observe`` lets stateful ops update from the data first."""
        for op in self.ops:
            try:
                if observe:
                    op.observe(x)
                x = op(x, rng)
            except ValueError as exc:
                raise ValueError(f"{op.name}: {exc}") from exc
        return x

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
        self, batch: Mapping[str, np.ndarray], rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        """A new dict with the augmented fields; other fields pass through, inputs untouched.

        Owned fields go first (stateful ops observe them), then aliases, which use the same
        ops and the same, already updated statistics, with their own random draws.
        """
        out = dict(batch)
        owned = [(f, f, True) for f in self.pipelines]
        for field, owner, observe in owned + [(f, o, False) for f, o in self.aliases.items()]:
            if field not in batch:
                raise ValueError(f"augment: batch has no field {field!r}")
            try:
                x = np.asarray(batch[field])
                out[field] = self.pipelines[owner].apply(x, rng, observe=observe)
            except ValueError as exc:
                raise ValueError(f"augment {field!r}: {exc}") from exc
        return out

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

        return Albumentations(params, load_settings().albumentations)
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
    spec: Mapping[str, Any] | None, *, stats: StatsStore | None = None
) -> AugmentPlan:
    """Build an :class:`AugmentPlan` from a recipe's ``augment`` section; its running
    statistics live in ``stats`` (default: this process, :class:`LocalStats`).

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
    return AugmentPlan(pipelines, aliases)

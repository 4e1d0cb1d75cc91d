"""Albumentations transforms a recipe names: ``{"albumentations": {"CoarseDropout": {...}}}``
as an augment op, run per image beside the vectorized built-ins.

Whoever registers a recipe chooses what the workers run, so a recipe may name only the
transforms the workers' settings allow (``CLAW_ALBUMENTATIONS``, comma-separated transform
names or the groups ``pixel`` — albumentations' pixel-level ``ImageOnlyTransform``\\s — and
``spatial`` — its ``DualTransform``\\s; default ``pixel,spatial``). Transforms that need more
than the image (masks, boxes, volumes, reference images read from files, fonts, callables)
are never allowed: :data:`NEVER`.

Randomness: one 32-bit seed per batch is drawn from the recipe's stream (``rng``) and seeds
the transform (``set_random_seed``), which then runs over the batch's images in order; so a
batch is reproducible from the recipe's seed, like the built-ins.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import numpy as np

from orchestrator.transforms.base import Op, as_images

GROUPS = ("pixel", "spatial")
NEVER = frozenset(
    {
        # other targets or metadata
        "AtLeastOneBBoxRandomCrop",
        "BBoxSafeRandomCrop",
        "RandomSizedBBoxSafeCrop",
        "RandomCropNearBBox",
        "CropNonEmptyMaskIfExists",
        "MaskDropout",
        "ConstrainedCoarseDropout",
        "OverlayElements",
        "Mosaic",
        # volumes
        "CenterCrop3D",
        "CoarseDropout3D",
        "Pad3D",
        "PadIfNeeded3D",
        "RandomCrop3D",
        "CubicSymmetry",
        "Transform3D",
        # reference images or fonts read from files, callables
        "FDA",
        "HistogramMatching",
        "PixelDistributionAdaptation",
        "TextImage",
        "Lambda",
    }
)


@cache
def _group(group: str) -> frozenset[str]:
    import albumentations as A

    base = {"pixel": A.ImageOnlyTransform, "spatial": A.DualTransform}[group]
    return (
        frozenset(
            name
            for name, obj in vars(A).items()
            if inspect.isclass(obj) and issubclass(obj, base) and obj is not base
        )
        - NEVER
    )


def allowed(entries: Iterable[str]) -> frozenset[str]:
    """The transform names an allowlist setting stands for (groups expanded)."""
    names: set[str] = set()
    for entry in entries:
        names |= _group(entry) if entry in GROUPS else {entry}
    return frozenset(names - NEVER)


class Albumentations(Op):
    """One albumentations 2.0.8 transform applied to each image of NHWC batches."""

    name = "albumentations"

    def __init__(self, spec: Any, allow: Iterable[str]) -> None:
        if not isinstance(spec, Mapping) or len(spec) != 1:
            raise ValueError(f"expected {{TransformName: {{params}}}}, got {spec!r}")
        transform, params = next(iter(spec.items()))
        params = {} if params is None else params
        permitted = allowed(allow)
        if transform not in permitted:
            raise ValueError(
                f"transform {transform!r} is not allowed on these workers (allowlist "
                f"CLAW_ALBUMENTATIONS; e.g. {sorted(permitted)[:8]}...); ask the operator "
                "to add it, or use a built-in op"
            )
        if not isinstance(params, Mapping):
            raise ValueError(f"{transform}: params must be a mapping, got {params!r}")
        import albumentations as A

        cls = getattr(A, transform)
        accepted = set(inspect.signature(cls).parameters)
        unknown = sorted(set(params) - accepted)
        if unknown:
            raise ValueError(f"{transform}: unknown params {unknown}; accepted {sorted(accepted)}")
        try:
            self.transform = cls(**params)
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"{transform}: {exc}") from exc
        self.label = transform

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        imgs = as_images(x)
        self.transform.set_random_seed(int(rng.integers(2**32)))
        out = [self.transform(image=im)["image"] for im in imgs]
        try:
            stacked = np.stack(out)
        except ValueError as exc:
            raise ValueError(f"{self.label} made images of different shapes: {exc}") from exc
        return stacked.reshape(*x.shape[:-3], *stacked.shape[1:])

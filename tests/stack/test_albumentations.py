"""Albumentations transforms named by a recipe: run in the prefetch workers with the
recipe's seeded stream, equal to albumentations called directly with the same seed; only
the transforms the workers' allowlist names."""

from __future__ import annotations

import albumentations as A
import numpy as np
import pytest
from pydantic import ValidationError

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.settings import use_settings
from claw_tasks.store import Store
from orchestrator import Recipe, sample
from orchestrator.delivery.client import BatchClient
from orchestrator.transforms.augment import build_pipelines

DROPOUT = {
    "num_holes_range": [2, 4],
    "hole_height_range": [0.1, 0.3],
    "hole_width_range": [0.1, 0.3],
    "fill": 0,
    "p": 1.0,
}


def _direct(images: np.ndarray, seed: int) -> np.ndarray:
    """CoarseDropout as albumentations runs it: seeded once, then image by image."""
    t = A.CoarseDropout(**{k: tuple(v) if isinstance(v, list) else v for k, v in DROPOUT.items()})
    t.set_random_seed(seed)
    return np.stack([t(image=im)["image"] for im in images])


def _images(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(1, 256, (n, 32, 32, 3), dtype=np.uint8)


def test_plan_matches_albumentations_with_the_same_seed():
    x = _images(16)
    x.flags.writeable = False  # no op writes into its input
    plan = build_pipelines({"obs": [{"albumentations": {"CoarseDropout": DROPOUT}}]})
    out = plan.apply({"obs": x}, np.random.default_rng(3))["obs"]
    seed = int(np.random.default_rng(3).integers(2**32))  # the op's one draw per batch
    np.testing.assert_array_equal(out, _direct(x, seed))
    assert out.dtype == np.uint8 and (out == 0).any(axis=(1, 2, 3)).all()  # holes in each


def test_prefetched_batch_matches_albumentations_with_the_recipe_seed(
    redis_url, namespace, start_worker
):
    n = 64
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    frames = _images(n)
    store.commit(
        StepBatch(
            episode=StrColumn.constant("e", n),
            step_index=np.arange(n),
            reward=np.zeros(n, np.float32),
            terminated=np.zeros(n, bool),
            truncated=np.zeros(n, bool),
            fields={"obs": frames},
        )
    )
    start_worker("prefetch", 1)
    client = BatchClient(namespace, redis_url)
    recipe = client.register(
        {
            "name": "drop",
            "batch_size": 8,
            "fields": ["obs"],
            "sources": [{"name": "all"}],
            "seed": 11,
            "prefetch": {"depth": 1},
            "augment": {"obs": [{"albumentations": {"CoarseDropout": DROPOUT}}]},
        }
    )
    batch = client.pop("drop", timeout=60)
    client.close()
    # Batch k of a seeded recipe draws from default_rng([seed, version, k]): first the
    # sampler (replayed here), then the op's seed.
    rng = np.random.default_rng([11, recipe.version, 1])
    here = sample(store, recipe, rng=rng)
    np.testing.assert_array_equal(here.ids, batch.ids)
    expected = _direct(store.get(batch.ids)["obs"], int(rng.integers(2**32)))
    np.testing.assert_array_equal(batch["obs"], expected)
    assert not np.array_equal(batch["obs"], store.get(batch.ids)["obs"])


def _recipe(transform: str, params: dict | None = None) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "r",
            "batch_size": 4,
            "fields": ["obs"],
            "sources": [{"name": "all"}],
            "augment": {"obs": [{"albumentations": {transform: params or {}}}]},
        }
    )


def test_only_allowlisted_transforms_are_accepted(monkeypatch):
    assert _recipe("GaussianBlur").augment  # pixel-level: allowed by default
    assert _recipe("HorizontalFlip").augment  # spatial: allowed by default
    for refused in ("FDA", "Lambda", "NoSuchTransform"):  # files / callables / unknown
        with pytest.raises(ValidationError, match=f"transform '{refused}' is not allowed"):
            _recipe(refused)
    monkeypatch.setenv("CLAW_ALBUMENTATIONS", "GaussianBlur")
    use_settings()
    assert _recipe("GaussianBlur").augment
    with pytest.raises(ValidationError, match="'CoarseDropout' is not allowed on these workers"):
        _recipe("CoarseDropout", DROPOUT)
    monkeypatch.setenv("CLAW_ALBUMENTATIONS", "")
    use_settings()
    with pytest.raises(ValidationError, match="'GaussianBlur' is not allowed"):
        _recipe("GaussianBlur")


def test_bad_albumentations_params_are_refused():
    with pytest.raises(ValidationError, match=r"CoarseDropout: unknown params \['holes'\]"):
        _recipe("CoarseDropout", {"holes": 3})
    with pytest.raises(ValidationError, match="CoarseDropout: "):
        _recipe("CoarseDropout", {"p": 7})

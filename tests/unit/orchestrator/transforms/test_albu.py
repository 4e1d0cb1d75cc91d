"""Albumentations transforms named by a recipe (transforms.albu): the plan equals
albumentations called directly with the same seed; only the allowlisted transforms, with
params albumentations accepts."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from claw_tasks.settings import use_settings
from orchestrator import Recipe
from orchestrator.transforms.augment import build_pipelines
from tests.support.albu import DROPOUT, direct, images


def test_plan_matches_albumentations_with_the_same_seed():
    x = images(16)
    x.flags.writeable = False  # no op writes into its input
    plan = build_pipelines({"obs": [{"albumentations": {"CoarseDropout": DROPOUT}}]})
    out = plan.apply({"obs": x}, np.random.default_rng(3))["obs"]
    seed = int(np.random.default_rng(3).integers(2**32))  # the op's one draw per batch
    np.testing.assert_array_equal(out, direct(x, seed))
    assert out.dtype == np.uint8 and (out == 0).any(axis=(1, 2, 3)).all()  # holes in each


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

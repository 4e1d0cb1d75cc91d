"""Vector index definitions and projections (no services): slices, downscaled images,
cosine, the feature allowlist, schema checks, and the recipe's ``nearest`` section."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.format.schema import FieldSpec
from orchestrator.recipe.model import Recipe
from orchestrator.retrieval.spec import IndexSpec, Projection, SpecError, spec_of
from orchestrator.retrieval.storage import check_field
from orchestrator.retrieval.vectors import exact_search


def double(x: np.ndarray, params: dict) -> np.ndarray:
    """A feature function for the allowlist test: ``scale`` times the flattened rows."""
    return x.reshape(len(x), -1) * params.get("scale", 2.0)


def test_a_slice_keeps_the_configured_part_of_each_row():
    p = Projection(spec_of({"slice": [[1, 5, 2]]}), (8,))
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    assert p.dim == 2
    assert p(x).tolist() == [[1, 3], [9, 11]]


def test_an_image_is_downscaled_by_mean_pooling_then_flattened():
    p = Projection(spec_of({"downscale": 2}), (4, 4, 3))
    img = np.zeros((1, 4, 4, 3), np.uint8)
    img[0, :2, :2, 0] = 200  # the top-left 2x2 block of channel 0
    out = p(img)
    assert p.dim == 2 * 2 * 3 and out.dtype == np.float32
    assert out.reshape(2, 2, 3)[0, 0, 0] == 200 and out.sum() == 200


def test_cosine_vectors_have_unit_length_and_a_zero_row_stays_zero():
    p = Projection(spec_of({"metric": "cosine"}), (3,))
    out = p(np.array([[3, 4, 0], [0, 0, 0]], np.float32))
    assert np.allclose(out[0], [0.6, 0.8, 0]) and (out[1] == 0).all()


def test_weights_scale_each_feature_and_never_touch_the_callers_states():
    p = Projection(spec_of({"weights": [2.0, 0.5], "metric": "cosine"}), (2,))
    states = np.array([[1.0, 4.0]], np.float32)
    assert np.allclose(p(states), [[2 / np.sqrt(8), 2 / np.sqrt(8)]])
    assert states.tolist() == [[1.0, 4.0]]  # queried states are the caller's batch
    with pytest.raises(SpecError, match="weights"):
        Projection(spec_of({"weights": [1.0]}), (2,))


def test_a_feature_function_runs_only_if_the_allowlist_names_it():
    name = "tests.unit.orchestrator.retrieval.test_spec:double"
    spec = spec_of({"feature": name, "params": {"scale": 3.0}})
    with pytest.raises(SpecError, match="CLAW_FEATURES"):
        Projection(spec, (2,), allowed=())
    p = Projection(spec, (2,), allowed=(name,))
    assert p(np.ones((1, 2), np.float32)).tolist() == [[3.0, 3.0]]


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"metric": "cosin"}, "metric"),
        ({"slice": [[0, 1, 0]]}, "step 0"),
        ({"feature": "nocolon"}, "module:function"),
        ({"wieght": 1}, "wieght"),
        ({"exact_below": -1}, "exact_below"),
        ({"recall": 1.5}, "recall"),
        ({"recall": 0}, "recall"),
        ({"recall": True}, "recall"),
        ({"recall": "0.9"}, "recall"),
        ({"recall": float("nan")}, "recall"),
        ({"nprobe": 0}, "nprobe"),
    ],
)
def test_bad_definitions_name_the_key(raw, match):
    with pytest.raises(SpecError, match=match) as got:
        spec_of(raw)
    assert "\n" not in str(got.value)


def test_the_field_must_be_a_fixed_numeric_field_of_the_namespace():
    fields = {
        "obs": FieldSpec("float32", (4,)),
        "tokens": FieldSpec("int32", (None,)),
        "img": FieldSpec("uint8", (8, 8, 3)),
    }
    assert check_field(spec_of({"field": "img", "downscale": 4}), fields).dim == 12
    with pytest.raises(SpecError, match="not a field"):
        check_field(spec_of({"field": "pixels"}), fields)
    with pytest.raises(SpecError, match="ragged"):
        check_field(spec_of({"field": "tokens"}), fields)
    with pytest.raises(SpecError, match="downscale"):
        check_field(spec_of({"downscale": 2}), fields)
    with pytest.raises(SpecError, match="2 axes"):
        check_field(spec_of({"slice": [[0, 1], [0, 1]]}), fields)


def test_lists_grow_with_the_square_root_of_capacity_and_train_within_a_quarter_of_it():
    spec = IndexSpec()
    assert spec.lists(1_000_000) == 16384 and spec.train_size(1_000_000) == 10 * 16384  # 2 levels
    assert spec.lists(100_000) == 512 and spec.train_size(100_000) == 39 * 512  # one k-means
    assert spec.lists(10_000) == 64 and spec.lists(10) == 64
    assert IndexSpec(nlist=100).lists(10**9) == 100


def test_exact_search_pads_past_the_candidates():
    base = np.array([[0, 0], [1, 0], [5, 5]], np.float32)
    dist, pos = exact_search(np.array([[0.9, 0]], np.float32), base, 5, "l2")
    assert pos[0].tolist() == [1, 0, 2, -1, -1]
    assert np.isnan(dist[0, 3:]).all() and np.isclose(dist[0, 0], 0.01)


def test_a_recipes_nearest_section_is_checked():
    base = {"name": "bc", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "a"}]}
    r = Recipe.model_validate({**base, "nearest": {"k": 4, "namespace": "experts"}})
    assert r.nearest is not None and r.nearest.fields == ["action"] and r.nearest.exclude_self
    with pytest.raises(ValueError, match=r"nearest\.query"):
        Recipe.model_validate({**base, "nearest": {"query": "state"}})
    with pytest.raises(ValueError, match="rows of one step"):
        Recipe.model_validate({**base, "sequence_length": 2, "nearest": {}})

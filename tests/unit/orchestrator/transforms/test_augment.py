"""Augmentation pipelines: exact shifts, untouched inputs, reproducibility, running stats."""

import json

import numpy as np
import pytest
from albumentations.augmentations.pixel import functional as fpixel

from orchestrator.transforms.augment import OPS, ColorJitter, build_pipelines

PAD = 4


def images(n: int, seed: int = 0, h: int = 20, w: int = 24, c: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, c), dtype=np.uint8)


def frozen(**arrays: np.ndarray) -> dict[str, np.ndarray]:
    """Read-only copies: any in-place write by an op raises."""
    out = {}
    for name, arr in arrays.items():
        arr = arr.copy()
        arr.flags.writeable = False
        out[name] = arr
    return out


def shift_of(original: np.ndarray, shifted: np.ndarray, pad: int) -> tuple[int, int]:
    """The (dy, dx) crop offset that turns ``original`` into ``shifted``, checked exactly."""
    h, w = original.shape[:2]
    padded = np.pad(original, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            if np.array_equal(padded[dy : dy + h, dx : dx + w], shifted):
                return dy, dx
    raise AssertionError("output is not a replicate-padded translation of the input")


def test_random_shift_is_pure_translation_with_replicate_padding():
    obs = images(64)
    out = build_pipelines({"obs": [{"random_shift": {"pad": PAD}}]}).apply(
        frozen(obs=obs), np.random.default_rng(1)
    )["obs"]
    assert out.dtype == obs.dtype and out.shape == obs.shape
    offsets = {shift_of(a, b, PAD) for a, b in zip(obs, out, strict=True)}
    assert len(offsets) > 10  # offsets are drawn per image


def test_random_shift_p_zero_is_identity_and_leading_axes_are_batch_axes():
    seq = images(12).reshape(3, 4, 20, 24, 3)
    plan = build_pipelines({"obs": [{"random_shift": {"pad": 2, "p": 0.0}}]})
    assert np.array_equal(plan.apply({"obs": seq}, np.random.default_rng(0))["obs"], seq)
    out = build_pipelines({"obs": [{"random_shift": {"pad": 2}}]}).apply(
        {"obs": seq}, np.random.default_rng(0)
    )["obs"]
    for a, b in zip(seq.reshape(-1, 20, 24, 3), out.reshape(-1, 20, 24, 3), strict=True):
        shift_of(a, b, 2)


def padded_shift(x: np.ndarray, rng: np.random.Generator, pad: int, p: float) -> np.ndarray:
    """The shift as first written: edge-pad the batch, then gather each image's window
    (the same draws, in the same order, as ``RandomShift``)."""
    imgs = x.reshape(-1, *x.shape[-3:])
    n, h, w, _ = imgs.shape
    dy, dx = rng.integers(0, 2 * pad + 1, n), rng.integers(0, 2 * pad + 1, n)
    if p < 1.0:
        skip = rng.random(n) >= p
        dy[skip] = dx[skip] = pad
    padded = np.pad(imgs, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
    return np.stack([padded[i, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)]).reshape(
        x.shape
    )


@pytest.mark.parametrize(
    ("shape", "dtype", "pad", "p"),
    [
        ((40, 84, 84, 3), np.uint8, 4, 1.0),
        ((3, 4, 9, 7, 1), np.uint8, 2, 0.5),  # leading axes, gray
        ((9, 10, 12, 4), np.float32, 4, 1.0),  # a stack of 4, float
        ((5, 4, 4, 3), np.int64, 6, 0.7),  # pad past the image: windows wholly in the pad
        ((4, 1, 1, 1), np.uint8, 3, 1.0),
        ((6, 10, 12, 4), np.bool_, 0, 1.0),
        ((6, 7, 5, 3), np.complex128, 3, 0.0),  # 48-byte pixels
        ((3, 6, 7, 200), np.uint8, 2, 1.0),  # more channels than OpenCV takes as uint8
        ((2, 4, 4, 129), np.uint8, 1, 0.6),  # no word divides 129 bytes within 128: numpy
    ],
)
def test_random_shift_matches_pad_then_crop_for_the_same_draws(shape, dtype, pad, p):
    x = (np.random.default_rng(5).random(shape) * 200).astype(dtype)
    op = OPS["random_shift"](pad=pad, p=p)
    want = padded_shift(x, np.random.default_rng(1), pad, p)
    got = op(x, np.random.default_rng(1))
    assert got.dtype == x.dtype and np.array_equal(got, want)
    out = np.empty_like(x)
    assert op(x, np.random.default_rng(1), out=out) is out and np.array_equal(out, want)


SPEC = {
    "obs": [{"random_shift": {"pad": PAD}}, {"color_jitter": {"brightness": 0.2, "hue": 0.1}}],
    "next_obs": "same",
    "state": [{"running_normalize": {"clip": 5.0}}, {"gaussian_noise": {"std": 0.1}}],
    "reward": [{"normalize": {"mean": 1.0, "std": 2.0}}],
}


def batch(seed: int = 0, n: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return frozen(
        obs=images(n, seed),
        next_obs=images(n, seed + 100),
        state=rng.normal(3.0, 2.0, (n, 5)),
        reward=rng.normal(size=n).astype(np.float32),
        action=rng.integers(0, 4, n),
    )


def test_inputs_untouched_and_other_fields_pass_through():
    data = batch()
    before = {k: v.copy() for k, v in data.items()}
    out = build_pipelines(SPEC).apply(data, np.random.default_rng(0))
    for name in data:
        assert np.array_equal(data[name], before[name])
    assert out["action"] is data["action"]
    for name in ("obs", "next_obs", "state", "reward"):
        assert not np.shares_memory(out[name], data[name])


def test_reproducible_with_a_seed():
    a = build_pipelines(SPEC).apply(batch(), np.random.default_rng(42))
    b = build_pipelines(SPEC).apply(batch(), np.random.default_rng(42))
    c = build_pipelines(SPEC).apply(batch(), np.random.default_rng(43))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["obs"], c["obs"])


def test_next_obs_same_pipeline_with_independent_draws():
    obs = images(64)
    plan = build_pipelines({"obs": [{"random_shift": {"pad": PAD}}], "next_obs": "same"})
    out = plan.apply(frozen(obs=obs, next_obs=obs), np.random.default_rng(0))
    off_obs = [shift_of(a, b, PAD) for a, b in zip(obs, out["obs"], strict=True)]
    off_next = [shift_of(a, b, PAD) for a, b in zip(obs, out["next_obs"], strict=True)]
    assert sum(a != b for a, b in zip(off_obs, off_next, strict=True)) > 32


def test_running_normalize_matches_numpy_over_concatenated_batches():
    spec = {"state": [{"running_normalize": {}}], "next_state": "same"}
    plan = build_pipelines(spec)
    rng = np.random.default_rng(0)
    seen = []
    for n in (7, 100, 1, 33):
        x = rng.normal(5.0, 3.0, (n, 4)) * [1, 10, 0.1, 1]
        seen.append(x)
        out = plan.apply({"state": x, "next_state": x + 1}, rng)
    data = np.concatenate(seen)
    state = plan.state_dict()["state"]["0"]
    assert state["count"] == len(data)
    np.testing.assert_allclose(state["mean"], data.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(state["var"], data.var(axis=0), rtol=1e-12)
    expected = (seen[-1] - data.mean(axis=0)) / np.sqrt(data.var(axis=0) + 1e-8)
    np.testing.assert_allclose(out["state"], expected, rtol=1e-5, atol=1e-6)
    # next_state shares the statistics (it does not update them): same shift of 1 / std.
    np.testing.assert_allclose(
        out["next_state"] - out["state"],
        np.broadcast_to(1 / np.sqrt(data.var(axis=0)), (33, 4)),
        rtol=1e-4,
    )
    assert out["state"].dtype == np.float32


def test_running_normalize_state_round_trips_and_clips():
    plan = build_pipelines({"v": [{"running_normalize": {"clip": 1.0}}]})
    x = np.random.default_rng(0).normal(size=(50, 3))
    plan.apply({"v": x}, np.random.default_rng(0))
    state = json.loads(json.dumps(plan.state_dict()))
    fresh = build_pipelines({"v": [{"running_normalize": {"clip": 1.0, "update": False}}]})
    fresh.load_state_dict(state)
    a = plan.apply({"v": x}, np.random.default_rng(0))["v"]
    b = fresh.apply({"v": x}, np.random.default_rng(0))["v"]
    assert np.abs(b).max() <= 1.0
    assert fresh.state_dict() == state  # update: false froze the stats
    np.testing.assert_allclose(a, b, atol=0.05)  # plan updated once more; fresh did not
    with pytest.raises(ValueError, match="no running_normalize"):
        fresh.load_state_dict({"v": {"3": state["v"]["0"]}})


def test_running_normalize_scalar_field():
    plan = build_pipelines({"reward": ["running_normalize"]})
    r = np.arange(10.0)
    out = plan.apply({"reward": r}, np.random.default_rng(0))["reward"]
    np.testing.assert_allclose(out, (r - r.mean()) / r.std(), rtol=1e-5)


@pytest.mark.parametrize("c", [1, 3])
def test_color_jitter_stays_uint8_in_range(c):
    x = images(40, c=c)
    spec = {"brightness": 0.9, "contrast": 0.9, "saturation": 0.9, "hue": 0.5, "p": 0.7}
    out = build_pipelines({"obs": [{"color_jitter": spec}]}).apply(
        frozen(obs=x), np.random.default_rng(0)
    )["obs"]
    assert out.dtype == np.uint8 and out.shape == x.shape
    changed = [not np.array_equal(a, b) for a, b in zip(x, out, strict=True)]
    assert 15 < sum(changed) < 40  # p = 0.7 per image


@pytest.mark.parametrize(
    ("component", "reference", "factor"),
    [
        ("brightness", fpixel.adjust_brightness_torchvision, 0.6),
        ("brightness", fpixel.adjust_brightness_torchvision, 1.4),
        ("contrast", fpixel.adjust_contrast_torchvision, 0.5),
        ("contrast", fpixel.adjust_contrast_torchvision, 1.3),
        ("saturation", fpixel.adjust_saturation_torchvision, 0.3),
        ("saturation", fpixel.adjust_saturation_torchvision, 1.6),
        ("hue", fpixel.adjust_hue_torchvision, 0.1),
        ("hue", fpixel.adjust_hue_torchvision, -0.3),
    ],
)
def test_color_jitter_components_match_albumentations(component, reference, factor):
    x = images(6)
    out = ColorJitter(**{component: [factor, factor]})(x, np.random.default_rng(0))
    expected = np.stack([reference(im, factor) for im in x])
    assert np.abs(out.astype(int) - expected).max() <= (0 if component == "hue" else 1)


def test_normalize_and_gaussian_noise():
    x = images(4)
    spec = {
        "obs": [{"normalize": {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "scale": 255}}]
    }
    out = build_pipelines(spec).apply({"obs": x}, np.random.default_rng(0))["obs"]
    assert out.dtype == np.float32
    expected = (x / 255.0 - [0.5, 0.4, 0.3]) / [0.2, 0.25, 0.3]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)

    v = np.zeros((20_000, 3), np.float32)
    noisy = build_pipelines({"v": [{"gaussian_noise": {"std": 0.5}}]}).apply(
        frozen(v=v), np.random.default_rng(0)
    )["v"]
    assert noisy.dtype == np.float32 and abs(noisy.std() - 0.5) < 0.01
    half = build_pipelines({"v": [{"gaussian_noise": {"std": 0.5, "p": 0.5}}]}).apply(
        {"v": v}, np.random.default_rng(0)
    )["v"]
    untouched_rows = (half == 0).all(axis=1).mean()
    assert 0.45 < untouched_rows < 0.55


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"obs": [{"rotate": {}}]}, r"'obs'.*unknown op 'rotate'"),
        ({"obs": [{"random_shift": {"pad": -1}}]}, r"'obs'.*random_shift.*pad"),
        ({"obs": [{"random_shift": {"pad": 2.5}}]}, r"'obs'.*random_shift.*pad"),
        ({"obs": [{"color_jitter": {"p": 2}}]}, r"'obs'.*color_jitter.*p must"),
        ({"obs": [{"color_jitter": {"hue": 0.7}}]}, r"'obs'.*color_jitter.*hue"),
        ({"obs": [{"color_jitter": {"brightnes": 0.2}}]}, r"'obs'.*color_jitter.*brightnes"),
        ({"v": [{"gaussian_noise": {}}]}, r"'v'.*gaussian_noise.*missing.*std"),
        ({"v": [{"normalize": {"std": 0}}]}, r"'v'.*normalize.*std"),
        ({"v": [{"running_normalize": {"clip": "x"}}]}, r"'v'.*running_normalize.*clip"),
        ({"v": [{"a": 1, "b": 2}]}, r"'v'.*expected"),
        ({"v": "same"}, r"'v'.*same"),
        ({"next_obs": "same"}, r"'next_obs'.*same"),
        ({"obs": {"random_shift": {}}}, r"'obs'.*list"),
    ],
)
def test_bad_specs_name_field_and_op(spec, match):
    with pytest.raises(ValueError, match=match):
        build_pipelines(spec)


def test_apply_errors_name_field_and_op():
    plan = build_pipelines({"state": [{"random_shift": {"pad": 2}}]})
    with pytest.raises(ValueError, match=r"'state'.*random_shift.*NHWC"):
        plan.apply({"state": np.zeros((4, 3))}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="no field 'state'"):
        plan.apply({"obs": np.zeros((4, 3))}, np.random.default_rng(0))
    jitter = build_pipelines({"obs": [{"color_jitter": {"brightness": 0.1}}]})
    with pytest.raises(ValueError, match=r"'obs'.*color_jitter.*uint8"):
        jitter.apply({"obs": np.zeros((2, 8, 8, 3), np.float32)}, np.random.default_rng(0))

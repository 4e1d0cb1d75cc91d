"""Frame stacks' layout (transforms.framestack): channels last, oldest frame first, as SB3's
VecFrameStack."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.transforms.framestack import stack_frames, stacked_shape


def test_layout_is_channels_last_oldest_first():
    gray = np.arange(3 * 4 * 2 * 2).reshape(3, 4, 2, 2)  # (B, k, H, W)
    out = stack_frames(gray, 2)
    assert out.shape == (3, 2, 2, 4) == (3, *stacked_shape((2, 2), 4))
    np.testing.assert_array_equal(out[1, :, :, 2], gray[1, 2])  # frame j is channel j
    rgb = np.arange(2 * 4 * 2 * 2 * 3).reshape(2, 4, 2, 2, 3)
    out = stack_frames(rgb, 3)
    assert out.shape == (2, 2, 2, 12) == (2, *stacked_shape((2, 2, 3), 4))
    np.testing.assert_array_equal(out[0, ..., 3:6], rgb[0, 1])  # frame j: channels 3j..3j+2
    vec = np.arange(2 * 3 * 5).reshape(2, 3, 5)
    assert stack_frames(vec, 1).tolist() == vec.reshape(2, 15).tolist()
    assert stacked_shape((), 4) == (4,)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((6, 5), "|u1"),
        ((6, 5, 3), "|u1"),
        ((6, 5), "<f4"),
        ((6, 5), "<i8"),
        ((7,), "|u1"),
        ((6, 5, 200), "|u1"),
        ((6, 5), "<f2"),
    ],
)
def test_stacks_gathered_by_index_are_the_stacked_frames(shape, dtype):
    """Distinct frames and an index (OpenCV's merge where it can, numpy elsewhere: vectors,
    int64, float16, over 512 channels) stack as the gathered frames do."""
    rng = np.random.default_rng(0)
    frames = (rng.random((9, *shape)) * 200).astype(dtype)
    index = rng.integers(0, 9, (3, 2, 4))
    got = stack_frames(frames, len(shape), index)
    want = stack_frames(frames[index], len(shape))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()

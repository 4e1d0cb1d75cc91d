"""Frame stacks as a batch holds them: k observations side by side on the last axis.

The store keeps each frame once (a step's own ``obs``); a recipe with ``frame_stack: k``
has the prefetch workers put a step's k most recent frames together
(:mod:`orchestrator.sampling.stacks` finds them). The layout is Stable-Baselines3's
``VecFrameStack`` for channels-last observations, so the stack is one image to the image
ops (one ``random_shift`` offset for all its frames, as DrQ shifts a stack):

- an ``(H, W)`` frame is taken as ``(H, W, 1)``: k of them make ``(H, W, k)``;
- any other frame is concatenated on its last axis: ``(H, W, C)`` makes ``(H, W, C*k)``
  (frame j's channels at ``[j*C, (j+1)*C)``), a vector ``(D,)`` makes ``(D*k,)``, a
  scalar ``()`` makes ``(k,)``;
- oldest first: the step's own frame is the last one.
"""

from __future__ import annotations

import numpy as np


def _frame_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a frame is stacked as (a channel axis added to ``(H, W)`` and ``()``)."""
    return (*shape, 1) if len(shape) in (0, 2) else shape


def stacked_shape(shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The shape of a stack of ``k`` frames of ``shape``."""
    frame = _frame_shape(tuple(shape))
    return (*frame[:-1], frame[-1] * k)


def stack_frames(frames: np.ndarray, ndim: int, index: np.ndarray | None = None) -> np.ndarray:
    """``(..., k, *frame)`` frames (oldest first; ``ndim`` = the frame's own dimensions)
    as ``(..., *stacked_shape(frame, k))``. With ``index`` (``(..., k)``), ``frames`` are
    ``(n, *frame)`` distinct frames, each stack the ones its row of ``index`` names
    (neighbouring steps' stacks share k - 1 frames, each decoded once)."""
    if index is not None:
        frames = np.take(frames, index, axis=0)
    lead = frames.shape[: frames.ndim - ndim - 1]
    k, frame = frames.shape[len(lead)], frames.shape[len(lead) + 1 :]
    shape = _frame_shape(frame)
    f = np.ascontiguousarray(frames).reshape(-1, k, *shape)
    # A frame's pixel (its last axis) is one unit: k strided copies of whole units
    # interleave the frames ~2x faster than a transpose of single items (an unsigned
    # integer of the pixel's size where there is one; numpy copies those natively).
    size = shape[-1] * f.dtype.itemsize
    unit = np.dtype(f"<u{size}") if size in (1, 2, 4, 8) else np.dtype((np.void, size))
    units = f.view(unit)[..., 0]  # (n, k, *shape[:-1])
    out = np.empty((len(f), *shape[:-1], k), unit)
    for j in range(k):
        out[..., j] = units[:, j]
    return out.view(frames.dtype).reshape(*lead, *stacked_shape(frame, k))

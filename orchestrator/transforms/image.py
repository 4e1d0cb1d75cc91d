"""Image ops on NHWC ``uint8`` batches: DrQ's random shift and colour jitter (vectorized
numpy and OpenCV; ``bench/augment.py`` times them against albumentations)."""

from __future__ import annotations

import cv2
import numpy as np

from orchestrator.transforms.base import Op, as_images, check_number, jitter_range

# RGB -> gray weights of OpenCV (and so of albumentations).
_LUMA = np.array([0.299, 0.587, 0.114])
# Channels a numpy array may have as an OpenCV matrix (cv2 5.0 refuses more).
_CV_CHANNELS = 128
# Element types OpenCV moves bytewise, widest first (copyMakeBorder copies pixels by size).
_WORDS = (np.float64, np.int32, np.uint16, np.uint8)


class RandomShift(Op):
    """DrQ random shift: replicate-pad by ``pad`` pixels, then crop back at a random offset.

    One pass per image: the crop of the padded image at ``(dy, dx)`` is the part of the
    image it overlaps, edge-replicated on the sides it runs past, so each output is one
    ``cv2.copyMakeBorder`` of that part (into ``out`` when given) and the padded batch is
    never built (2.5x faster than padding, then gathering windows). Pixels are moved as
    whole byte groups, so any dtype shifts.
    """

    name = "random_shift"

    def __init__(self, pad: int = 4, p: float = 1.0) -> None:
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise ValueError(f"pad must be a non-negative integer, got {pad!r}")
        self.pad = pad
        self.p = check_number("p", p, 0.0, 1.0)

    writes_out = True

    def out_spec(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...]]:
        return dtype, shape

    def __call__(
        self, x: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None
    ) -> np.ndarray:
        imgs, pad = as_images(x), self.pad
        n, h, w, _ = imgs.shape
        dy = rng.integers(0, 2 * pad + 1, n)
        dx = rng.integers(0, 2 * pad + 1, n)
        if self.p < 1.0:
            skip = rng.random(n) >= self.p
            dy[skip] = dx[skip] = pad
        res = np.empty(x.shape, x.dtype) if out is None else out
        if _words(imgs) is None:  # pixels wider than OpenCV takes: clamped index gathers
            rows = np.clip(np.arange(h) + (dy - pad)[:, None], 0, h - 1)
            cols = np.clip(np.arange(w) + (dx - pad)[:, None], 0, w - 1)
            at = np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]
            res.reshape(imgs.shape)[...] = imgs[at]
            return res
        src, dst = _pixels(np.ascontiguousarray(imgs)), _pixels(res.reshape(imgs.shape))
        y0, y1, top, bottom = _overlap(dy - pad, h)
        x0, x1, left, right = _overlap(dx - pad, w)
        border, replicate = cv2.copyMakeBorder, cv2.BORDER_REPLICATE
        for i in range(n):
            part = src[i, y0[i] : y1[i], x0[i] : x1[i]]
            border(part, top[i], bottom[i], left[i], right[i], replicate, dst=dst[i])
        return res


def _words(imgs: np.ndarray) -> type | None:
    """The widest element type that divides a pixel's bytes in at most OpenCV's channel
    limit; None when none does (e.g. 129 uint8 channels)."""
    size = imgs.shape[-1] * imgs.dtype.itemsize
    for word in _WORDS:
        k = np.dtype(word).itemsize
        if size % k == 0 and size // k <= _CV_CHANNELS:
            return word
    return None


def _pixels(imgs: np.ndarray) -> np.ndarray:
    """NHWC images of any dtype as a view OpenCV takes: each pixel's bytes as channels of
    :func:`_words`' type (the pixel moves as a whole either way)."""
    n, h, w, c = imgs.shape
    word = _words(imgs)
    assert word is not None
    size = c * imgs.dtype.itemsize
    return imgs.view(np.uint8).reshape(n, h, w, size).view(word)


def _overlap(shift: np.ndarray, size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per image, along one axis of ``size``: the source range ``[lo, hi)`` a window starting
    at ``shift`` (in image coordinates) overlaps, at least one pixel (a window wholly past
    an edge repeats that edge), and the replicated pixels before and after it."""
    lo = np.clip(shift, 0, size - 1)
    hi = np.clip(shift + size, 1, size)
    before = np.clip(lo - shift, 0, size - (hi - lo))
    after = size - before - (hi - lo)
    return lo.tolist(), hi.tolist(), before.tolist(), after.tolist()


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
        self.brightness = jitter_range("brightness", brightness, 1.0, 0.0, np.inf)
        self.contrast = jitter_range("contrast", contrast, 1.0, 0.0, np.inf)
        self.saturation = jitter_range("saturation", saturation, 1.0, 0.0, np.inf)
        self.hue = jitter_range("hue", hue, 0.0, -0.5, 0.5)
        self.p = check_number("p", p, 0.0, 1.0)

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

    writes_out = True

    def out_spec(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...]]:
        return dtype, shape

    def __call__(
        self, x: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None
    ) -> np.ndarray:
        imgs = np.ascontiguousarray(as_images(x))
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

        res = np.empty(x.shape, x.dtype) if out is None else out
        dst = res.reshape(imgs.shape)
        for i in np.flatnonzero(~apply):  # image by image: no gathered temporary
            dst[i] = imgs[i]
        for i in np.flatnonzero(apply):
            if not with_hue:
                cv2.transform(imgs[i], pre[i], dst=dst[i])
                continue
            y = cv2.cvtColor(cv2.transform(imgs[i], pre[i]), cv2.COLOR_RGB2HSV)
            y[..., 0] = cv2.LUT(y[..., 0], hue_luts[i])
            y = cv2.cvtColor(y, cv2.COLOR_HSV2RGB)
            post[i, :, c] *= cv2.mean(y)[:c] @ luma if post_contrast else 0.0
            cv2.transform(y, post[i], dst=dst[i])
        return res

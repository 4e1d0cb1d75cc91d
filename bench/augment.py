"""Augmentation throughput per core (Claw vs albumentations 2.0.8 per-image loops) and batch
decode latency (shared memory vs bytes). Prints markdown tables.

    .venv/bin/python bench/augment.py [--batch 256] [--repeat 30] [--cpu 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import albumentations as A
import cv2
import numpy as np

from orchestrator.delivery import shm
from orchestrator.delivery.wire import WireBatch, decode_batch, to_wire
from orchestrator.sampling.batch import Batch
from orchestrator.transforms.augment import build_pipelines

H = W = 84
PAD = 4


def median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alb_loop(transform: A.BasicTransform, batch: dict[str, np.ndarray]) -> Callable[[], object]:
    """Trainer-style baseline: albumentations on each image of obs and next_obs."""
    return lambda: {
        k: np.stack([transform(image=im)["image"] for im in v]) for k, v in batch.items()
    }


def augment_rows(batch: dict[str, np.ndarray], repeat: int) -> list[tuple[str, float, float]]:
    n_images = sum(len(v) for v in batch.values())
    rng = np.random.default_rng(0)
    cases = [
        (
            f"random_shift pad {PAD}",
            [{"random_shift": {"pad": PAD}}],
            A.Compose(
                [
                    A.PadIfNeeded(H + 2 * PAD, W + 2 * PAD, border_mode=cv2.BORDER_REPLICATE),
                    A.RandomCrop(H, W),
                ]
            ),
        ),
    ]
    jitters = [
        {"brightness": 0.2, "p": 0.8},
        {"brightness": 0.2, "contrast": 0.2, "saturation": 0.2},
        {"brightness": 0.2, "contrast": 0.2, "saturation": 0.2, "hue": 0.1},
    ]
    off = {"brightness": 0, "contrast": 0, "saturation": 0, "hue": 0, "p": 1.0}
    for params in jitters:
        label = "color_jitter " + ", ".join(f"{k} {v}" for k, v in params.items())
        cases.append((label, [{"color_jitter": params}], A.ColorJitter(**{**off, **params})))
    cases.append(
        (
            "recipe example: random_shift + color_jitter brightness 0.2 p 0.8",
            [{"random_shift": {"pad": PAD}}, {"color_jitter": jitters[0]}],
            A.Compose([*cases[0][2].transforms, A.ColorJitter(**{**off, **jitters[0]})]),
        )
    )
    dropout = {
        "num_holes_range": (2, 4),
        "hole_height_range": (0.1, 0.3),
        "hole_width_range": (0.1, 0.3),
        "p": 1.0,
    }
    cases.append(
        (
            "albumentations CoarseDropout named in the recipe (no built-in)",
            [{"albumentations": {"CoarseDropout": dropout}}],
            A.CoarseDropout(**dropout),
        )
    )
    rows = []
    for label, ops, alb in cases:
        plan = build_pipelines({"obs": ops, "next_obs": "same"})
        claw_s = median_s(lambda plan=plan: plan.apply(batch, rng), repeat)
        alb_s = median_s(alb_loop(alb, batch), max(3, repeat // 3))
        rows.append((label, n_images / claw_s, n_images / alb_s))
    return rows


def decode_rows(
    wire: WireBatch, batch: dict[str, np.ndarray], repeat: int
) -> list[tuple[str, float]]:
    blob = wire.tobytes()
    host = shm.host_id()
    sink = {k: np.empty_like(v) for k, v in batch.items()}

    def touch(decoded: Batch) -> None:
        for k in sink:
            np.copyto(sink[k], decoded[k])

    def copy_from_bytes() -> None:
        touch(decode_batch(blob))

    def from_shm(copy_out: bool) -> float:
        times = []
        for _ in range(repeat):
            msg = shm.to_message(wire, reader_host=host, threshold=0)
            start = time.perf_counter()
            decoded = shm.from_message(msg)
            if copy_out:
                touch(decoded)
            times.append(time.perf_counter() - start)
            del decoded
        return statistics.median(times)

    def shm_round_trip() -> None:
        shm.from_message(shm.to_message(wire, reader_host=host, threshold=0))

    return [
        ("reader: decode from bytes in memory", median_s(lambda: decode_batch(blob), repeat)),
        ("reader: map + decode from shm", from_shm(copy_out=False)),
        ("reader: decode from bytes + copy every array out", median_s(copy_from_bytes, repeat)),
        ("reader: map + decode from shm + copy every array out", from_shm(copy_out=True)),
        ("writer: encode to bytes", median_s(wire.tobytes, repeat)),
        ("writer + reader: shm write, map, decode", median_s(shm_round_trip, repeat)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--cpu", type=int, default=0, help="core to pin to")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    cv2.setNumThreads(1)

    rng = np.random.default_rng(0)
    shape = (args.batch, H, W, 3)
    batch = {
        "obs": rng.integers(0, 256, shape, dtype=np.uint8),
        "next_obs": rng.integers(0, 256, shape, dtype=np.uint8),
    }
    print(f"## Augmentation, {args.batch} x obs + next_obs uint8 {H}x{W}x3, one core\n")
    print("| op | Claw images/s | albumentations loop images/s | speed-up |")
    print("|---|---:|---:|---:|")
    for label, claw, alb in augment_rows(batch, args.repeat):
        print(f"| {label} | {claw:,.0f} | {alb:,.0f} | {claw / alb:.1f}x |")
    n = args.batch
    wire = to_wire(
        {**batch, "reward": np.zeros(n, np.float32)}, ids=np.arange(n), weights=np.ones(n)
    )
    print(f"\n## One {wire.nbytes / 1e6:.1f} MB batch (obs + next_obs + reward): wire cost\n")
    print("| step | median ms |")
    print("|---|---:|")
    for label, seconds in decode_rows(wire, batch, args.repeat):
        print(f"| {label} | {seconds * 1e3:.3f} |")


if __name__ == "__main__":
    main()

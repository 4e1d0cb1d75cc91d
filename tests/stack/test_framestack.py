"""Frame stacks (recipe ``frame_stack``): each frame stored once, stacked by the sampler.

The layout (SB3's VecFrameStack, channels last), the predecessor links against a brute-force
inverse of ``next`` (built at once and kept current from changed rows), and whole batches
from a real Redis: each stack holds exactly its step's newest frames, zeros before the
episode's start, ``next_obs`` shifted by one (n-step too), and a step whose stack has a gap
(an evicted predecessor) is never drawn.
"""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from orchestrator import Recipe, sample
from orchestrator.recipe.base import RecipeError
from tests.support.stepdata import batch, episode, interleave

# ---- whole batches from Redis --------------------------------------------------------
LENGTH = {1: 9, 2: 3, 3: 6}
K = 4


def frame(ep: int, t: int, explicit: bool = False) -> np.ndarray:
    """A 12x10 grayscale frame naming its step (value 1 + 20 ep + t; +100 when explicit)."""
    return np.full((12, 10), 1 + 20 * ep + t + 100 * explicit, np.uint8)


def commit(store: Store, color: bool) -> None:
    steps = interleave(
        *(episode(e, LENGTH[e], "terminated" if e == 2 else "truncated") for e in LENGTH)
    )
    for part in (steps[:5], steps[5:]):  # episodes span two commits
        b = batch(part)
        b.fields["obs"] = np.stack([frame(s["ep"], s["step"]) for s in part])
        if len(b.next_rows):
            b.next_obs = np.stack(
                [frame(part[i]["ep"], part[i]["step"] + 1, True) for i in b.next_rows]
            )
        if color:
            b.fields["obs"] = np.repeat(b.fields["obs"][..., None], 3, -1)
            if b.next_obs is not None:
                b.next_obs = np.repeat(b.next_obs[..., None], 3, -1)
        store.commit(b)


def frames_of(stack: np.ndarray, color: bool) -> list[int]:
    """The step each frame of a (12, 10, k[*3]) stack names (its first pixel's value)."""
    px = stack[0, 0]
    return (px[::3] if color else px).astype(int).tolist()


def want_next(ep: int, boot: int) -> int:
    last = LENGTH[ep] - 1
    if boot < last:
        return 1 + 20 * ep + boot + 1
    return 0 if ep == 2 else 1 + 20 * ep + boot + 1 + 100  # terminated: zeros; else explicit


@pytest.mark.parametrize(
    ("color", "n", "codec"),
    [
        (False, 1, None),
        (True, 1, None),
        (False, 3, None),
        (True, 3, None),
        (False, 3, "zstd"),
        (True, 1, "png"),
        (False, 3, "delta:4"),
    ],
)
def test_batches_hold_each_steps_newest_frames(redis_url, namespace, color, n, codec):
    """Raw and compressed obs (each frame stored once, compressed or not)."""
    store = Store(redis_url, namespace)
    obs = FieldSpec("|u1", (12, 10, 3) if color else (12, 10), codec=codec)
    schema = Schema(fields={"obs": obs, "action": FieldSpec("<i8", ())})
    store.create(capacity=1000, n_shards=2, schema=schema)
    commit(store, color)
    r = Recipe.model_validate(
        {
            "name": "stack",
            "batch_size": 64,
            "fields": ["obs", "next_obs", "step_index"],
            "sources": [{"name": "all"}],
            "frame_stack": K,
            "n_step": n,
            "gamma": 0.5,
            "augment": {"obs": [{"random_shift": {"pad": 1}}], "next_obs": "same"}
            if n == 3
            else {},
        }
    )
    out = sample(store, r, rng=np.random.default_rng(n))
    c = 3 if color else 1
    assert out["obs"].shape == out["next_obs"].shape == (64, 12, 10, K * c)
    seen = set()
    for obs, nxt, t in zip(out["obs"], out["next_obs"], out["step_index"].tolist(), strict=True):
        ep = (int(obs[0, 0, -1]) - 1) // 20
        seen.add((ep, t))
        want = [1 + 20 * ep + s if s >= 0 else 0 for s in range(t - K + 1, t + 1)]
        assert frames_of(obs, color) == want
        boot = min(t + n - 1, LENGTH[ep] - 1)
        older = [1 + 20 * ep + s if s >= 0 else 0 for s in range(boot - K + 2, boot + 1)]
        assert frames_of(nxt, color) == [*older, want_next(ep, boot)]
    assert {t for _, t in seen} >= {0, 1, 5}  # episode starts are drawn, zero-padded


@pytest.mark.parametrize(
    ("codec", "k", "length"), [("png", 4, 1), ("delta:4", 4, 1), ("png", 1, 1), ("zstd", 1, 3)]
)
def test_compressed_frames_decoded_once_give_the_raw_batch(redis_url, namespace, codec, k, length):
    """A batch's shared frames (stack positions, next_obs, repeated draws, explicit next_obs
    and zeros) are decoded once each: the batch is byte for byte the raw namespace's."""
    rng = np.random.default_rng(7)
    pixels = {key: rng.integers(0, 256, (12, 10), np.uint8) for key in range(400)}

    def noise(ep: int, t: int, explicit: bool = False) -> np.ndarray:
        return pixels[(20 * ep + t + 100 * explicit) % 400]

    out = []
    for n, c in enumerate((None, codec)):
        store = Store(redis_url, f"{namespace}-{n}")
        obs = FieldSpec("|u1", (12, 10), codec=c)
        store.create(capacity=1000, n_shards=2, schema=Schema(fields={"obs": obs}))
        steps = interleave(
            *(episode(e, LENGTH[e], "terminated" if e == 2 else "truncated") for e in LENGTH)
        )
        b = batch(steps)
        b.fields = {"obs": np.stack([noise(s["ep"], s["step"]) for s in steps])}
        b.next_obs = np.stack(
            [noise(steps[i]["ep"], steps[i]["step"] + 1, True) for i in b.next_rows]
        )
        store.commit(b)
        r = {
            "name": "same",
            "batch_size": 48,
            "fields": ["obs", "next_obs", "step_index"],
            "sources": [{"name": "all"}],
            "frame_stack": k,
            "sequence_length": length,
        }
        out.append(sample(store, r, rng=np.random.default_rng(3)))
    raw, got = out
    assert got["step_index"].tolist() == raw["step_index"].tolist()
    for name in ("obs", "next_obs"):
        assert got[name].dtype == raw[name].dtype and got[name].shape == raw[name].shape
        assert got[name].tobytes() == raw[name].tobytes()


def test_a_stack_with_a_gap_is_never_drawn(redis_url, namespace):
    store = Store(redis_url, namespace)
    store.create(capacity=1000, n_shards=1)
    commit(store, color=False)
    ep1 = store.episode("ep1", fields=[])
    store.evict([int(ep1["id"][ep1["step_index"] == 2][0])])
    r = Recipe.model_validate(
        {
            "name": "stack",
            "batch_size": 256,
            "fields": ["obs", "step_index", "episode_id"],
            "sources": [{"name": "all"}],
            "frame_stack": K,
        }
    )
    out = sample(store, r, rng=np.random.default_rng(0))
    drawn = {
        (e, t) for e, t in zip(out.meta["episode_id"], out["step_index"].tolist(), strict=True)
    }
    assert not drawn & {("ep1", t) for t in range(2, 6)}  # their stacks hold step 2
    assert {("ep1", 0), ("ep1", 1), ("ep1", 6)} <= drawn


def test_recipe_checks(redis_url, namespace):
    base = {"name": "s", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "a"}]}
    with pytest.raises(ValueError, match="frame_stack stacks one step's frames"):
        Recipe.model_validate({**base, "frame_stack": 4, "sequence_length": 2})
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    store.commit(batch(episode(1, 3)))  # obs float32[4]: a vector stacks too
    assert sample(store, {**base, "frame_stack": 2})["obs"].shape == (4, 8)
    with pytest.raises(RecipeError, match="random_shift cannot apply"):
        sample(store, {**base, "frame_stack": 2, "augment": {"obs": [{"random_shift": {}}]}})

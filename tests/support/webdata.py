"""Episodes for the web inspector's tests and bench: 16x16 RGB frames (a bright square
that moves with the step), a 4-value state vector, an action, tags, and ``info`` dicts
(some hostile: they must render as text)."""

from __future__ import annotations

import numpy as np

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store

SIDE = 16
XSS = (
    '<script>window.__xss = 1</script>"><img src=x onerror="window.__xss=2">'
    "' onmouseover='window.__xss=3' <svg onload=window.__xss=4>"
)


def frames(ep: int, n: int) -> np.ndarray:
    f = np.zeros((n, SIDE, SIDE, 3), np.uint8)
    f[..., 2] = 40 + 20 * (ep % 8)
    for i in range(n):
        x = i % (SIDE - 4)
        f[i, 4:10, x : x + 4, 0] = 255
    return f


def episode_batch(
    ep: int, n: int, *, task: str, agent: str, seed: int = 0, hostile: bool = False
) -> StepBatch:
    rng = np.random.default_rng([seed, ep])
    end = np.zeros(n, bool)
    end[-1] = True
    info = [{"note": XSS if hostile else f"step {i}", "i": i} for i in range(0, n, 5)]
    return StepBatch(
        episode=StrColumn.constant(f"ep{ep}", n),
        step_index=np.arange(n),
        reward=rng.uniform(-1, 1, n).astype(np.float32),
        terminated=end,
        truncated=np.zeros(n, bool),
        fields={
            "obs": frames(ep, n),
            "state": rng.standard_normal((n, 4)).astype(np.float32),
            "action": rng.integers(0, 4, n),
        },
        strs={
            "task_id": StrColumn.constant(task, n),
            "agent_id": StrColumn.constant(agent, n),
            "t:label": StrColumn.constant(XSS if hostile else "plain", n),
        },
        nums={"t:level": np.full(n, float(ep % 3))},
        info_rows=np.arange(0, n, 5, dtype=np.int32),
        info=info,
    )


def fill(
    url: str,
    ns: str,
    episodes: int = 8,
    length: int = 20,
    *,
    capacity: int = 10_000,
    n_shards: int = 2,
    hostile: tuple[int, ...] = (),
) -> Store:
    """``episodes`` episodes ``ep0``, ``ep1``, … of ``length`` steps."""
    store = Store(url, ns)
    store.create(capacity=capacity, n_shards=n_shards)
    for e in range(episodes):
        store.commit(
            episode_batch(
                e, length, task=("grasp", "reach")[e % 2], agent=f"a{e % 3}", hostile=e in hostile
            )
        )
    return store

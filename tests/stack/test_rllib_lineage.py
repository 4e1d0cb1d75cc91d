"""Lineage of the RLlib buffers: each ``sample()`` is recorded as training the learner update
it feeds (``policy_version="updates"``: DQN and SAC run one update per sample), so ``claw
lineage NS --policy v`` returns exactly the rows sample v returned, on the prefetched path
(parts of a popped batch, read ahead), the deterministic one and the multi-agent buffer (one
entry per module); other declarations (``timesteps``, a callable, None) and the count going
on after a get_state/set_state restore. Real Redis and Celery workers, no Ray start."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("ray.rllib", reason="ray[rllib] is not installed (pip install -e '.[rllib]')")

from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from typer.testing import CliRunner

from claw_tasks.store import Store
from orchestrator.adapters.rllib import (
    ClawEpisodeReplayBuffer,
    ClawMultiAgentEpisodeReplayBuffer,
    ClawPrioritizedEpisodeReplayBuffer,
)
from orchestrator.cli.main import app
from orchestrator.delivery.lineage import LineageLog
from tests.stack.test_rllib_multi_agent import ma_samples


def numbered_episode(e: int, length: int) -> SingleAgentEpisode:
    """Observation 1000 e + t: every step's obs names it."""
    eps = SingleAgentEpisode(id_=f"e{e}", observations=[float(1000 * e)])
    for t in range(length):
        eps.add_env_step(observation=float(1000 * e + t + 1), action=t % 2, reward=1.0)
    eps.is_terminated = True
    return eps


def _stored_obs(store: Store, entries: list) -> np.ndarray:
    ids = np.concatenate([e.ids for e in entries])
    return np.sort(store.get(ids, fields=["obs"])["obs"].reshape(-1))


@pytest.mark.parametrize(
    ("cls", "deterministic"),
    [
        (ClawEpisodeReplayBuffer, False),
        (ClawEpisodeReplayBuffer, True),
        (ClawPrioritizedEpisodeReplayBuffer, False),
    ],
)
def test_which_data_trained_update_v_is_what_sample_v_returned(
    redis_url, namespace, workers, cls, deterministic
):
    """48 samples in one burst (the buffer re-plans: a popped batch serves several
    samples), then more after an add; the log holds one version per sample, each with
    exactly the rows that sample returned (n-step 3: its first observations)."""
    buf = cls(
        5000,
        namespace=namespace,
        redis_url=redis_url,
        timeout=60,
        deterministic=deterministic,
    )
    buf.add([numbered_episode(e, 40) for e in range(10)])
    served = []
    for burst in (48, 8):
        for _ in range(burst):
            got = buf.sample(16, n_step=3, gamma=0.9, beta=0.4)
            served.append(np.sort([e.get_observations(0) for e in got]))
            if cls is ClawPrioritizedEpisodeReplayBuffer:
                buf.update_priorities(np.ones(16))
        buf.add(numbered_episode(100 + burst, 10))
    assert buf.updates == len(served) == 56
    buf.close()
    store = Store(redis_url, namespace)
    log = LineageLog(store)
    assert log.counts() == {str(v): 1 for v in range(1, 57)}
    for v, obs in enumerate(served, 1):
        (entry,) = log.trained(v)
        assert entry.rows == 16
        np.testing.assert_array_equal(_stored_obs(store, [entry]), obs)
    cli = CliRunner().invoke(
        app, ["lineage", namespace, "--policy", "7", "--json"], env={"CLAW_REDIS_URL": redis_url}
    )
    assert cli.exit_code == 0, cli.output
    doc = json.loads(cli.stdout)
    assert (doc["batches"], doc["rows"]) == (1, 16)


def test_the_multi_agent_buffer_records_each_sample(redis_url, namespace, workers):
    """One sample of two modules (one batch, both modules' rows): one entry of its
    version, with the rows of both."""
    calls = ma_samples(MultiAgentCartPole({"num_agents": 2}), seed=5, steps=100, chunk=10)
    buf = ClawMultiAgentEpisodeReplayBuffer(
        5000, namespace=namespace, redis_url=redis_url, timeout=60
    )
    for call in calls:
        buf.add(call)
    served = []
    for _ in range(12):
        got = buf.sample(8, n_step=2, gamma=0.9)
        assert [e.module_id for e in got] == ["p0"] * 8 + ["p1"] * 8
        served.append(np.sort([e.get_observations(0)[0] for e in got]))
    buf.close()
    store = Store(redis_url, namespace)
    log = LineageLog(store)
    assert log.counts() == {str(v): 1 for v in range(1, 13)}
    for v, want in enumerate(served, 1):
        (entry,) = log.trained(v)
        assert entry.rows == 16
        got = np.sort(store.get(entry.ids, fields=["obs"])["obs"][:, 0])
        np.testing.assert_array_equal(got, want)


def test_other_declarations_and_a_restored_buffer(redis_url, namespace, workers):
    """``timesteps`` records the env steps added at the sample, a callable what it returns
    for the sample's number, None nothing; a buffer restored from get_state goes on
    counting updates where the saved one stopped."""
    kw = {"namespace": namespace, "redis_url": redis_url, "timeout": 60, "deterministic": True}
    buf = ClawEpisodeReplayBuffer(5000, policy_version="timesteps", **kw)
    buf.add([numbered_episode(e, 30) for e in range(3)])
    buf.sample(4)
    buf.policy_version = lambda k: f"iter-{k // 2}"
    buf.sample(4)
    buf.sample(4)
    buf.policy_version = None
    buf.sample(4)
    buf.policy_version = "updates"
    state = buf.get_state()
    buf.close()
    fresh = ClawEpisodeReplayBuffer(50)
    fresh.set_state(state)
    assert fresh.policy_version == "updates" and fresh.updates == 4
    fresh.sample(4)
    fresh.close()
    log = LineageLog(Store(redis_url, namespace))
    assert log.counts() == {"90": 1, "iter-1": 2, "5": 1}
    with pytest.raises(ValueError, match="policy_version='epochs'"):
        ClawEpisodeReplayBuffer(10, policy_version="epochs", **kw)

"""ClawEpisodeReplayBuffer against RLlib's own EpisodeReplayBuffer (new API stack): the same
episodes give the same n-step transitions, keys and train batch; RLlib's buffer tests that
apply, ported (docs/adapters.md lists which and why not the others); get_state/set_state
through a checkpoint file; over real Redis and Celery workers. No test here starts Ray:
the buffers never need it, and a Ray start costs more than these tests together. The
DQN learning run is `-m slow`."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import gymnasium as gym
import msgpack
import numpy as np
import pytest

pytest.importorskip("ray.rllib", reason="ray[rllib] is not installed (pip install -e '.[rllib]')")

from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402
from ray.rllib.connectors.common.add_observations_from_episodes_to_batch import (  # noqa: E402
    AddObservationsFromEpisodesToBatch,
)
from ray.rllib.connectors.learner.add_next_observations_from_episodes_to_train_batch import (  # noqa: E402
    AddNextObservationsFromEpisodesToTrainBatch,
)
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import (  # noqa: E402
    EpisodeReplayBuffer,
)
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (  # noqa: E402
    PrioritizedEpisodeReplayBuffer,
)

from claw_tasks.settings import use_settings  # noqa: E402
from orchestrator.adapters.rllib import (  # noqa: E402
    ClawEpisodeReplayBuffer,
    ClawPrioritizedEpisodeReplayBuffer,
)

RECENT = {"sources": [{"name": "all", "sampler": {"kind": "recent"}}]}  # every stored row


def cartpole_samples(seed: int, steps: int, chunk: int, limit: int) -> list[list]:
    """What a one-env ``SingleAgentEnvRunner.sample()`` returns, call after call: the
    episodes that ended, and the running one cut every ``chunk`` steps (its next chunk
    has the same ``id_``); random actions, episodes truncated at ``limit`` steps."""
    env = gym.make("CartPole-v1", max_episode_steps=limit)
    env.action_space.seed(seed)
    calls, out = [], []

    def reset() -> SingleAgentEpisode:
        eps = SingleAgentEpisode(
            observation_space=env.observation_space, action_space=env.action_space
        )
        obs, info = env.reset(seed=seed + len(calls) + len(out))
        eps.add_env_reset(obs, info)
        return eps

    eps = reset()
    for t in range(1, steps + 1):
        a = env.action_space.sample()
        obs, r, term, trunc, info = env.step(a)
        eps.add_env_step(obs, a, r, info, terminated=term, truncated=trunc)
        if term or trunc:
            out.append(eps.to_numpy())
            eps = reset()
        if t % chunk == 0 or t == steps:
            if len(eps):
                running = eps
                eps = running.cut()
                out.append(running.to_numpy())
            calls.append(out)
            out = []
    return calls


def _claw(redis_url: str, namespace: str, cls=ClawEpisodeReplayBuffer, **kw):
    kw.setdefault("deterministic", True)
    kw.setdefault("timeout", 60)
    return cls(kw.pop("capacity", 1000), namespace=namespace, redis_url=redis_url, **kw)


def _by_key(episodes: list[SingleAgentEpisode]) -> dict[tuple[str, int], SingleAgentEpisode]:
    return {(e.id_, e.t_started): e for e in episodes}


def _lengths(calls: list[list]) -> dict[str, int]:
    """Steps stored per episode id after all the calls."""
    n: dict[str, int] = {}
    for call in calls:
        for eps in call:
            n[eps.id_] = n.get(eps.id_, 0) + len(eps)
    return n


def _train_batch(config: DQNConfig, episodes: list[SingleAgentEpisode]) -> dict:
    """DQN's learner connector over ``episodes`` (with the NEXT_OBS piece DQN's learner
    inserts): the tensors its loss reads."""
    env = gym.make("CartPole-v1")
    module = config.get_multi_rl_module_spec(env=env).build()
    pipeline = config.build_learner_connector(
        input_observation_space=env.observation_space, input_action_space=env.action_space
    )
    pipeline.insert_after(
        AddObservationsFromEpisodesToBatch, AddNextObservationsFromEpisodesToTrainBatch()
    )
    batch = pipeline(
        rl_module=module, batch={}, episodes=episodes, explore=False, shared_data={}, metrics=None
    )
    return batch["default_policy"]


@pytest.mark.parametrize("n_step", [1, 3])
def test_transitions_keys_and_shapes_match_rllibs_buffer(redis_url, namespace, workers, n_step):
    """Every n-step transition of the same episodes (chunks of running episodes joined by
    id, episodes ending terminated and truncated), as both buffers return them."""
    gamma = 0.9
    calls = cartpole_samples(seed=1, steps=90, chunk=7, limit=20)
    ref = EpisodeReplayBuffer(capacity=1000)
    ref.rng = np.random.default_rng(0)
    claw = _claw(redis_url, namespace, recipe=RECENT)
    for call in calls:
        ref.add(call)
        claw.add(call)
    total = sum(_lengths(calls).values())
    assert len(claw) == len(ref) == total
    got = claw.sample(num_items=total, n_step=n_step, gamma=gamma, sample_episodes=True)
    drawn = ref.sample(num_items=4000, n_step=n_step, gamma=gamma, sample_episodes=True)
    want = _by_key(drawn)
    assert len(got) == total and set(_by_key(got)) == set(want)  # every step, once
    ended = {e.id_ for call in calls for e in call if e.is_done}
    terminated = {e.id_ for call in calls for e in call if e.is_terminated}
    assert any(e.is_terminated for call in calls for e in call)
    assert any(e.is_truncated for call in calls for e in call)
    lengths = _lengths(calls)
    for g in got:
        w = want[(g.id_, g.t_started)]
        assert len(g) == len(w) == 1
        np.testing.assert_array_equal(g.get_observations(0), w.get_observations(0))
        np.testing.assert_array_equal(g.get_observations(-1), w.get_observations(-1))
        assert g.get_actions(0) == w.get_actions(0)
        np.testing.assert_allclose(g.get_rewards(0), w.get_rewards(0), rtol=1e-6)
        m = min(n_step, lengths[g.id_] - g.t_started)  # the window, cut at the stored end
        if g.t_started + n_step > lengths[g.id_]:  # cut at the end: RLlib's slice drops
            assert g.is_terminated == (g.id_ in terminated)  # the flag (ts + n > len)
        else:
            assert g.is_terminated == w.is_terminated
        assert g.get_extra_model_outputs("n_step", 0) == m
        assert w.get_extra_model_outputs("n_step", 0) == n_step  # RLlib's: n even when cut
        assert g.get_extra_model_outputs("weights", 0) == w.get_extra_model_outputs("weights", 0)
        assert set(g.extra_model_outputs) == set(w.extra_model_outputs) == {"n_step", "weights"}
        if n_step == 1:
            assert g.is_truncated == w.is_truncated
        else:
            assert g.is_truncated == (not g.is_terminated and m < n_step)
        if m < n_step and g.id_ in ended:
            assert g.is_terminated or g.is_truncated
    config = DQNConfig().environment("CartPole-v1")
    pairs = [want[(g.id_, g.t_started)] for g in got[:8]]  # before: the connector renames
    mine = _train_batch(config, got[:8])
    theirs = _train_batch(config, pairs)
    assert set(mine) == set(theirs) >= {
        "obs",
        "new_obs",
        "actions",
        "rewards",
        "terminateds",
        "truncateds",
        "n_step",
        "weights",
    }
    for k in theirs:
        assert (mine[k].shape, mine[k].dtype) == (theirs[k].shape, theirs[k].dtype), k
    np.testing.assert_allclose(mine["new_obs"].numpy(), theirs["new_obs"].numpy())
    claw.close()

"""TorchRL's ReplayBuffer over ClawStorage and the Claw samplers, against real Redis and
Celery workers: batches flow as TensorDicts with the keys, dtypes and shapes they were
extended with, each sample is recorded in the lineage log as training its update,
priorities reach Claw and change what is drawn, the state is kept without the data, and
TorchRL's own samplers are refused with the fix."""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import RandomSampler, ReplayBuffer, TensorDictReplayBuffer

from claw_tasks.store import Store
from orchestrator.adapters.torchrl import ClawPrioritizedSampler, ClawSampler, ClawStorage
from orchestrator.delivery.lineage import LineageLog
from tests.support.processes import run_example

OBS = 4


def _transitions(n: int, trajs: int = 2, seed: int = 0, special_every: int = 0) -> TensorDict:
    """``n`` rows as a collector gives them (flattened): ``trajs`` interleaved trajectories
    with their ids, next observation = the trajectory's next observation, one-hot int64
    actions, rewards and done flags of shape (n, 1); every 9th step of a trajectory ends
    it (odd ones as timeouts). With ``special_every``, every such row has reward 1."""
    rng = np.random.default_rng(seed)
    obs = np.zeros((n, OBS), np.float32)
    nxt = np.zeros((n, OBS), np.float32)
    traj = np.zeros(n, np.int64)
    term = np.zeros((n, 1), bool)
    trunc = np.zeros((n, 1), bool)
    current = [rng.normal(size=OBS).astype(np.float32) for _ in range(trajs)]
    steps, ids = [0] * trajs, list(range(trajs))
    for i in range(n):
        k = i % trajs
        obs[i], traj[i] = current[k], ids[k]
        nxt[i] = rng.normal(size=OBS).astype(np.float32)
        steps[k] += 1
        if steps[k] % 9 == 0:
            (trunc if ids[k] % 2 else term)[i] = True
            ids[k] += trajs
            current[k] = rng.normal(size=OBS).astype(np.float32)
        else:
            current[k] = nxt[i]
    action = np.eye(2, dtype=np.int64)[rng.integers(0, 2, n)]
    reward = np.zeros((n, 1), np.float32)
    if special_every:
        reward[::special_every] = 1.0
    else:
        reward[:] = rng.normal(size=(n, 1))
    return TensorDict(
        {
            "observation": torch.from_numpy(obs),
            "action": torch.from_numpy(action),
            "collector": {"traj_ids": torch.from_numpy(traj)},
            "next": {
                "observation": torch.from_numpy(nxt),
                "reward": torch.from_numpy(reward),
                "terminated": torch.from_numpy(term),
                "truncated": torch.from_numpy(trunc),
                "done": torch.from_numpy(term | trunc),
            },
        },
        batch_size=[n],
    )


def _row_keys(td: TensorDict) -> set[tuple]:
    parts = [
        td["observation"],
        td["action"].float(),
        td["next", "observation"],
        td["next", "reward"],
        td["next", "terminated"].float(),
        td["next", "truncated"].float(),
    ]
    rows = torch.cat([p.reshape(len(td), -1).float() for p in parts], 1).numpy()
    return {tuple(np.round(r, 5)) for r in rows}


def test_batches_flow_as_tensordicts_with_the_extended_layout(redis_url, namespace, workers):
    data = _transitions(120)
    storage = ClawStorage(1000, namespace, redis_url, timeout=60)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=32)
    try:
        rb.extend(data)
        assert len(rb) == 120
        batch = rb.sample()
        assert batch.batch_size == torch.Size([32])
        for key in [
            "observation",
            "action",
            ("next", "observation"),
            ("next", "reward"),
            ("next", "done"),
            ("next", "terminated"),
            ("next", "truncated"),
        ]:
            assert batch[key].dtype == data[key].dtype, key
            assert batch[key].shape[1:] == data[key].shape[1:], key
        assert batch["index"].dtype == torch.int64
        assert _row_keys(batch) <= _row_keys(data)  # every sampled row is an extended one
        assert (
            batch["next", "done"] == (batch["next", "terminated"] | batch["next", "truncated"])
        ).all()
        # next_obs was stored once for the rows inside an episode, explicitly at its end
        assert Store(redis_url, namespace).count() == 120
    finally:
        storage.close()


def test_each_sample_is_recorded_as_training_its_update(redis_url, namespace, workers):
    """The default ``policy_version="updates"``: sample k trains version k, the ids the
    sampler returned; ``"timesteps"`` and a callable; the counters kept by ``state_dict``;
    the old counter names and ``drop_on_empty`` (an argument, or in a saved state) are
    refused with the new ones."""
    storage = ClawStorage(1000, namespace, redis_url, timeout=60, batches_per_pop=2)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=16)
    drawn = []
    try:
        rb.extend(_transitions(100))
        for _ in range(5):
            drawn.append(np.sort(rb.sample()["index"].numpy()))
        with pytest.raises(ValueError, match="policy_version='frames' is now 'timesteps'"):
            storage.policy_version = "frames"
        storage.policy_version = "timesteps"
        rb.extend(_transitions(20, seed=1))
        drawn.append(np.sort(rb.sample()["index"].numpy()))
        storage.policy_version = lambda k: f"update-{k}"
        drawn.append(np.sort(rb.sample()["index"].numpy()))
        state = storage.state_dict()
        assert state["samples"] == 7 and state["frames"] == 120
        kw = {k: v for k, v in state["claw"].items() if k != "drop_on_reset"}
        old = {**state, "claw": {**kw, "drop_on_empty": False}}
        with pytest.raises(ValueError, match="has drop_on_empty=, which is now drop_on_reset="):
            storage.load_state_dict(old)
    finally:
        storage.close()  # sends what is left of the lineage
    with pytest.raises(TypeError, match="drop_on_empty= is now drop_on_reset="):
        ClawStorage(10, namespace, redis_url, drop_on_empty=True)
    with pytest.raises(ValueError, match="policy_version='samples' is now 'updates'"):
        ClawStorage(10, namespace, redis_url, policy_version="samples")
    log = LineageLog(Store(redis_url, namespace))
    assert log.counts() == {"1": 1, "2": 1, "3": 1, "4": 1, "5": 1, "120": 1, "update-7": 1}
    for version, ids in zip(["1", "2", "3", "4", "5", "120", "update-7"], drawn, strict=True):
        (entry,) = log.trained(version)
        assert np.array_equal(entry.ids, ids), version  # two samples a pop: each its own


def test_priorities_reach_claw_and_change_the_sampling_distribution(redis_url, namespace, workers):
    data = _transitions(200, special_every=10)  # 20 rows with reward 1
    data["td_error"] = torch.ones(200)  # priorities given at extend: none unset
    storage = ClawStorage(1000, namespace, redis_url, timeout=60, readahead=2, batches_per_pop=1)
    sampler = ClawPrioritizedSampler(alpha=1.0, beta=0.4)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=64)
    try:
        rb.extend(data)
        first = rb.sample()
        assert "priority_weight" in first.keys()  # noqa: SIM118  (TensorDict has no `in`)
        shares, uneven = [], 0
        for _ in range(80):
            batch = rb.sample()
            weights = batch["priority_weight"]
            assert weights.dtype == torch.float32 and weights.shape == (64,)
            uneven += not torch.all(weights == weights[0])  # rows of unequal priority
            special = batch["next", "reward"].reshape(-1) == 1.0
            shares.append(special.float().mean().item())
            batch["td_error"] = torch.where(special, 1.0, 1e-4)
            rb.update_tensordict_priority(batch)
        assert np.mean(shares[:5]) < 0.4  # ~10% before any update
        assert np.mean(shares[-10:]) > 0.9  # the others' priorities went to 1e-4
        assert uneven > 0
    finally:
        storage.close()


def test_update_priority_skips_indices_the_sampler_never_returned(redis_url, namespace, workers):
    storage = ClawStorage(1000, namespace, redis_url, timeout=60)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawPrioritizedSampler(), batch_size=8)
    try:
        rb.extend(_transitions(50))
        batch = rb.sample()
        with pytest.warns(UserWarning, match="did not return"):
            rb.update_priority(batch["index"] + 10_000, torch.ones(8))
    finally:
        storage.close()


def test_state_is_kept_without_the_data_and_reconnects(redis_url, namespace, workers, tmp_path):
    storage = ClawStorage(1000, namespace, redis_url, timeout=60)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=16)
    data = _transitions(80)
    rb.extend(data)
    state = storage.state_dict()
    json.dumps(state)  # plain values only
    assert state["claw"]["namespace"] == namespace and state["added"] == 80
    rb.dumps(tmp_path / "rb")
    copy = pickle.loads(pickle.dumps(storage))  # a process of its own gets the settings
    storage.close()
    assert len(copy) == 80 and copy.namespace == namespace
    copy.close()

    again = TensorDictReplayBuffer(
        storage=ClawStorage(10, "elsewhere", redis_url), sampler=ClawSampler(), batch_size=16
    )
    again.loads(tmp_path / "rb")
    try:
        assert again.storage.namespace == namespace and len(again) == 80
        assert _row_keys(again.sample()) <= _row_keys(data)  # the data stayed in Redis
    finally:
        again.storage.close()


def test_empty_moves_to_a_new_generation_and_keeps_the_old_data(redis_url, namespace, workers):
    storage = ClawStorage(1000, namespace, redis_url, timeout=60)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=8)
    try:
        rb.extend(_transitions(40, seed=1))
        storage.flush()
        rb.empty()
        assert len(rb) == 0 and storage.namespace == f"{namespace}.r1"
        new = _transitions(30, seed=2)
        rb.extend(new)
        assert _row_keys(rb.sample()) <= _row_keys(new)
        assert Store(redis_url, namespace).count() == 40
    finally:
        storage.close()


def test_torchrls_own_sampler_and_other_data_are_refused_with_the_fix(
    redis_url, namespace, workers
):
    storage = ClawStorage(1000, namespace, redis_url, timeout=60)
    try:
        rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=4)
        rb.extend(_transitions(20))
        with pytest.raises(KeyError, match="ClawSampler"):
            rb.sample()
        plain = ReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=4)
        with pytest.raises(TypeError, match="extend a TensorDict"):
            plain.extend(torch.zeros(4, 3))
        with pytest.raises(KeyError, match="obs_key"):
            rb.extend(TensorDict({"pixels": torch.zeros(2, 3)}, batch_size=[2]))
    finally:
        storage.close()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_torchrl_dqn_on_cartpole_reaches_a_mean_return_of_150(redis_url, namespace, workers):
    """examples/torchrl_dqn.py at full length (30k frames, seed 0) learns
    CartPole through ClawStorage and ClawPrioritizedSampler."""
    out = run_example(
        "torchrl_dqn.py", redis_url, "--namespace", namespace, "--seed", "0", timeout=3000
    )
    print(out)
    mean = float(re.search(r"greedy mean return over 10 episodes: ([\d.]+)", out)[1])
    assert mean >= 150, out


def test_sampling_an_empty_storage_raises_at_once_as_torchrl_does(redis_url, namespace, workers):
    """TorchRL's storages raise ``RuntimeError("Cannot sample from an empty storage")``;
    so does ClawStorage, new or emptied, without waiting for a pop's timeout (an hour
    here: the test would time out first)."""
    storage = ClawStorage(100, namespace, redis_url, timeout=3600)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=4)
    try:
        with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
            rb.sample()
        rb.extend(_transitions(20))
        assert len(rb.sample()) == 4
        rb.empty()
        with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
            rb.sample()
    finally:
        storage.close()


def test_a_full_storage_samples_only_the_rows_torchrl_would_keep(redis_url, namespace, workers):
    """Five rows into ``ClawStorage(3)``: TorchRL's ring keeps the newest three, and so
    does the namespace's ring (``capacity`` defaults to ``max_size``): samples draw those
    three and never the two overwritten rows.

    Each row is flushed before the next is extended: the namespace's ring keeps the
    newest rows *committed*, and a ring of 3 sends each row in a message of its own
    (``ingest_options``: at most half the ring a message), which the worker's two pool
    processes may commit out of order (a row committed after its successor outlives it:
    the ring then keeps it, without its next observation, in place of the successor)."""
    data = _transitions(5, trajs=1)
    storage = ClawStorage(3, namespace, redis_url, timeout=60)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=64)
    try:
        for i in range(5):
            rb.extend(data[i : i + 1])
            storage.flush()
        assert len(rb) == 3
        assert Store(redis_url, namespace).config().capacity == 3
        kept, drawn = _row_keys(data[2:]), set()
        for _ in range(8):  # 64 uniform draws of 3 rows: the first sample has all three
            drawn |= _row_keys(rb.sample())
            assert drawn <= kept  # never an overwritten row
            if drawn == kept:
                break
        assert drawn == kept
    finally:
        storage.close()


def test_deterministic_storages_with_one_seed_sample_alike(redis_url, namespace, workers):
    """``seed`` and ``deterministic``, as SB3's and RLlib's buffers take them: two storages
    given the same extends and the same seed draw the same rows, sample after sample; a
    third with another seed does not."""
    data = _transitions(200, seed=3)

    def run(ns: str, seed: int) -> list[list[tuple]]:
        storage = ClawStorage(1000, ns, redis_url, timeout=60, seed=seed, deterministic=True)
        rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=16)
        try:
            rb.extend(data[:120])
            got = [rb.sample() for _ in range(3)]
            rb.extend(data[120:])
            got += [rb.sample() for _ in range(3)]
            return [sorted(_row_keys(g)) for g in got]  # the rows, not their ids
        finally:
            storage.close()

    a, b, c = run(f"{namespace}-a", 7), run(f"{namespace}-b", 7), run(f"{namespace}-c", 8)
    assert a == b
    assert a != c

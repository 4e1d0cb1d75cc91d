"""LLM turns as steps (Schema.llm, Ingestor.llm_turn) and rewards attached after the fact,
through a real ingest worker and the change log."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import Schema, SchemaError
from claw_tasks.format.turns import prompt_key
from claw_tasks.store.turns import attach_rewards, turn_infos
from orchestrator.cli.main import app
from orchestrator.sampling.index import SamplingIndex


def test_turns_round_trip_and_rewards_reach_the_index(redis_url, namespace, ingest_worker):
    ing = Ingestor(namespace, redis_url, schema=Schema.llm(response_mask=True), flush_interval=None)
    rng = np.random.default_rng(0)
    sent = {}
    for traj, group in (("a", "g1"), ("b", "g1"), ("c", "g2")):
        for turn in range(3):
            p = rng.integers(0, 50_000, 5 + turn).tolist()
            r = rng.integers(0, 50_000, 4).tolist()
            lp = (-rng.random(4)).astype(np.float32).tolist()
            sent[traj, turn] = (p, r, lp)
            ing.llm_turn(
                traj,
                turn,
                p,
                r,
                lp,
                prompt_uid=group,
                response_mask=[1, 1, 0, 1],
                policy_version=7,
                messages=[{"role": "user", "content": f"hi {turn}"}],
                dataset="toy",
            )
    with pytest.raises(SchemaError, match="3 response_logprobs for 4 response_ids"):
        ing.llm_turn("x", 0, [1], [1, 2, 3, 4], [-0.1] * 3)
    with pytest.raises(SchemaError, match="finite values <= 0"):
        ing.llm_turn("x", 0, [1], [1], [0.5])
    assert ing.close().committed == 9
    store = ing.store
    got = store.episode("b", fields=[*Schema.llm(response_mask=True).fields])
    for turn in range(3):
        p, r, lp = sent["b", turn]
        assert got["prompt_ids"][turn].tolist() == p
        assert got["response_ids"][turn].tolist() == r
        np.testing.assert_array_equal(got["response_logprobs"][turn], np.float32(lp))
        assert got["response_mask"][turn].tolist() == [1, 1, 0, 1]
    assert got["tags.prompt_uid"].tolist() == [prompt_key("g1")] * 3
    # default fields on a namespace without obs: every field, no next_obs (was KeyError 'obs')
    default = store.episode("b")
    assert "next_obs" not in default and "has_next_obs" not in default
    assert default["response_ids"][2].tolist() == sent["b", 2][1]
    assert set(store.get(default["id"][:1])) == set(default)
    with pytest.raises(KeyError, match="next_obs needs an 'obs' field"):
        store.get(default["id"][:1], ["next_obs"])
    cli = CliRunner(env={"CLAW_REDIS_URL": redis_url})
    out = cli.invoke(app, ["inspect", store.namespace, "--episode", "b"])
    assert out.exit_code == 0, out.output
    assert "response_ids=int32[4]" in out.output and "next_obs" not in out.output
    out = cli.invoke(app, ["query", store.namespace, "step_index > 0", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["matched"] == 6  # 3 trajectories, turns 1 and 2
    assert got["policy_version"].tolist() == [7, 7, 7]
    assert not got["terminated"].any()

    ix = SamplingIndex(store)
    ix.sync()
    assert attach_rewards(store, "b", 1.0, [0.25, 0.0, 0.0], reward_source="verifier") == 3
    changed = ix.sync()
    assert len(changed) == 3
    alive = ix.columns["alive"]
    col = {k: v[alive] for k, v in ix.columns.items()}
    b = col["episode"] == col["episode"][col["reward"] == 1.0][0]
    assert sorted(col["reward"][b].tolist()) == [0.0, 0.25, 1.0]
    assert col["t:final_reward"][b].tolist() == [1.0] * 3
    assert np.isnan(col["t:final_reward"][~b]).all() and (col["reward"][~b] == 0).all()
    assert (col["flags"][b] & 1).sum() == 1 and (col["flags"][~b] & 1).sum() == 0

    after = store.episode("b", fields=[])
    assert after["reward"].tolist() == [0.25, 0.0, 1.0]
    assert after["terminated"].tolist() == [False, False, True]
    assert after["reward_source"] == ["verifier"] * 3
    assert turn_infos(store, after["id"][:1])[0]["messages"] == json.dumps(
        [{"role": "user", "content": "hi 0"}], separators=(",", ":")
    )
    with pytest.raises(ValueError, match="has 3 stored turns, expected 4"):
        attach_rewards(store, "a", 1.0, expect_turns=4)


def test_episode_index_finds_turns_without_the_column(own_redis_url, namespace, tmp_path):
    """With ``episode_index`` a trajectory's turns come from its index entry (no read of the
    shard's episode column: no GET of a column chunk), in turn order, evicted and
    overwritten steps left out, and the entry goes with the trajectory's last step."""
    from claw_tasks.format.stepmeta import episode_code
    from claw_tasks.store.turns import trajectory_step_ids
    from tests.support.processes import Worker

    worker = Worker(own_redis_url, "ingest", 1, tmp_path / "worker.log", {})
    try:
        ing = Ingestor(
            namespace, own_redis_url, schema=Schema.llm(), capacity=16, flush_interval=None
        )
        store = ing.store
        store.set_episode_index()
        for turn in (1, 0, 2):  # committed out of order, interleaved with other trajectories
            for traj in "abc":
                ing.llm_turn(traj, turn, [1, 2], [3 + turn], [-0.5], prompt_uid="g")
            ing.flush()
        ing.close()
    finally:
        worker.stop()
    column = {t: store.episode(t, fields=[])["id"].tolist() for t in "abc"}
    store.r.config_resetstat()
    got = {t: trajectory_step_ids(store, t, 3).tolist() for t in "abc"}
    assert "cmdstat_get" not in store.r.info("commandstats")  # no column chunk read
    assert got == column
    assert [store.get(got["b"], fields=[])["step_index"].tolist()] == [[0, 1, 2]]

    store.evict(got["b"][1:2])
    assert store.trajectory_ids("b").tolist() == [got["b"][0], got["b"][2]]
    store.evict(got["c"])
    assert store.trajectory_ids("c").tolist() == []
    key = store.layout_keys.shard_key(0, "eptraj")
    assert not store.r.hexists(key, str(episode_code("c"))) and store.r.hexists(
        key, str(episode_code("a"))
    )
    with pytest.raises(KeyError, match="no stored steps"):
        trajectory_step_ids(store, "c")

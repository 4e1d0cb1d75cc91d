"""On-policy rollouts through the prefetch workers: consume-once by policy version over 4
actors and several versions (allowed versions only, each step once per epoch, no step in
two rollouts, stale steps never served and counted exactly, a learner restart resumes
instead of receiving a rollout again), GAE and V-trace in the workers against numpy
references of the recorded steps, and the recipe's checks."""

from __future__ import annotations

import time
from collections import Counter

import gymnasium as gym
import numpy as np
import pytest
from typer.testing import CliRunner

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.format.schema import Schema, SchemaError
from claw_tasks.store import Store
from orchestrator import BatchClient
from orchestrator.cli.main import app
from orchestrator.delivery.prefetch import run_fill
from orchestrator.delivery.registry import Registry
from orchestrator.delivery.rollout_state import read_state
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.index import SamplingIndex
from tests.support.rollout_actors import (
    STRAGGLER,
    Actor,
    gae_reference,
    keys_of,
    pop_rollout,
    recipe,
    wait_state,
)


def test_consume_once_by_version_with_four_actors(redis_url, workers, namespace):
    records: dict = {}
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    actors = [Actor(ing, k, records, seed=k) for k in range(4)]
    slow = Actor(ing, STRAGGLER, records, seed=99)
    client = BatchClient(namespace, redis_url)
    client.register(recipe(max_lag=1))
    served: set = set()
    stale = 0
    for v in range(5):
        for a in actors:
            a.segment(16, v)
        if v in (1, 3):  # one actor runs ahead: 8 steps of v more than a rollout takes
            actors[0].segment(8, v)
        if v >= 3:  # a slow actor still on version 1: stale, never served
            slow.segment(5, 1)
            stale += 5
        ing.flush()
        taken = pop_rollout(client, records, (v - 1, v))
        assert not taken & served, "a step was served in two rollouts"
        served |= taken
        if v == 2:  # a lagged rollout: the 8 steps of version 1 left over are in it
            assert Counter(records[k]["version"] for k in taken) == {1: 8, 2: 56}
        st = client.stats("ppo")["ppo"]
        assert st["rollout"]["rollouts"] == v + 1
        client.set_params("ppo", policy_version=v + 1)
    # The state of the fill the version change asked for (the last rollout's fill left a
    # "waiting" state of 3..4 that the new one replaces).
    st = wait_state(client, "waiting for rollout of policy_version 4..5")
    assert st["state"].startswith("waiting for rollout of policy_version 4..5: 16 of 64"), st
    assert st["rollout"]["dropped_stale"] == stale == 10
    assert not any(k[0] == STRAGGLER for k in served)
    out = CliRunner().invoke(app, ["recipes", namespace], env={"CLAW_REDIS_URL": redis_url})
    line = "rollouts 5 (serving policy_version 4: 12/12 minibatches pushed), dropped stale 10"
    assert line in " ".join(out.output.split()), out.output
    client.close()
    ing.close()


def test_gae_in_workers_and_a_learner_restart(redis_url, workers, namespace):
    """Minibatch advantages and returns equal GAE of the recorded steps; a learner that
    restarts mid-rollout gets the rest of it, not the rollout again; asked again (the same
    version set once more) it gets all of it again; steps left over at max_lag 0 are
    counted stale when the version moves."""
    records: dict = {}
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    actors = [Actor(ing, k, records, seed=10 + k) for k in range(4)]
    for a in actors:
        a.segment(16, 0)
    actors[1].segment(6, 0)  # 70 steps of version 0: 6 are left over
    ing.flush()
    client = BatchClient(namespace, redis_url)
    client.register(recipe(max_lag=0))
    first = [client.pop("ppo", timeout=60) for _ in range(5)]
    client.close()
    client = BatchClient(namespace, redis_url)  # a restart: the same recipe again
    client.register(recipe(max_lag=0))
    rest = [client.pop("ppo", timeout=60) for _ in range(7)]
    got = [(b.meta["rollout"]["epoch"], b.meta["rollout"]["minibatch"]) for b in first + rest]
    assert got == [divmod(k, 4) for k in range(12)]
    taken = {key for b in first[:4] for key in keys_of(b)}
    ref = gae_reference(taken, records)
    for b in first + rest:
        keys = keys_of(b)
        adv = np.array([ref[k] for k in keys])
        np.testing.assert_allclose(b["advantages"], adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b["returns"], adv + b["value"], rtol=1e-5, atol=1e-5)
    client.set_params("ppo", policy_version=0)  # asked again: the rollout from its start
    again = [client.pop("ppo", timeout=60) for _ in range(4)]
    assert {key for b in again for key in keys_of(b)} == taken
    client.set_params("ppo", policy_version=1)
    st = wait_state(client, "waiting for rollout of policy_version 1")
    assert st["rollout"]["dropped_stale"] == 6, st
    client.close()
    ing.close()


def test_rollout_recipe_checks():
    ok = Recipe.model_validate(recipe())
    assert ok.rollout is not None and ok.rollout.steps == 64
    bad = [
        ({"rollout": {"steps": 60}}, "multiple of batch_size"),
        ({"params": {}}, "params.policy_version must be the policy version"),
        ({"n_step": 3}, "not with n_step"),
        ({"sources": [{"name": "a", "sampler": {"kind": "priority"}}]}, "one source"),
        ({"rollout": {"steps": 64, "advantage": "vtrace", "max_lag": 2}}, "name a scorer"),
        ({"fields": ["obs", "advantages"]}, "added by rollout"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            Recipe.model_validate(recipe() | change)
    schema = Schema(fields=Schema.rollout((3,)).fields)  # no log_prob/value tags
    with pytest.raises(ValueError, match="numeric tags log_prob, value"):
        ok.validate_against(schema)


def test_truncated_rollout_step_needs_its_bootstrap(redis_url, workers, namespace):
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    ep = ing.episode()
    obs = np.zeros(3, np.float32)
    with pytest.raises(SchemaError, match="truncated with a 'value' but no 'bootstrap_value'"):
        ep.add(obs, np.int64(0), 1.0, truncated=True, log_prob=-0.5, value=0.1)
    ep.add(obs, np.int64(0), 1.0, truncated=True, log_prob=-0.5, value=0.1, bootstrap_value=0.2)
    assert ing.close().committed == 1


def test_record_steps_segments_and_versions(redis_url, workers, namespace):
    """RecordSteps with value_fn and segment_steps: every 5th step (across episodes) and
    every truncated one carries bootstrap_value = value_fn(next_obs); the policy version
    set mid-episode applies from the next step on; log_prob and value are tags."""
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((4,)), flush_interval=None)
    cartpole = gym.make("CartPole-v1", max_episode_steps=7)
    env = RecordSteps(cartpole, ing, value_fn=lambda o: 100 + float(o[0]), segment_steps=5)
    env.policy_version = 0
    obs, _ = env.reset(seed=0)
    flags = []
    for t in range(23):
        if t == 12:
            env.policy_version = 1
        obs, _, term, trunc, _ = env.step(t % 2, log_prob=-0.5, value=float(t))
        flags.append((term, trunc, 100 + float(obs[0])))
        if term or trunc:
            obs, _ = env.reset()
    ing.close()
    index = SamplingIndex(Store(redis_url, namespace))
    index.sync()
    cols = index.columns
    order = np.argsort(cols["id"])[-23:]
    assert cols["t:value"][order].tolist() == [float(t) for t in range(23)]
    boot = cols["t:bootstrap_value"][order]
    for t, (term, trunc, v_next) in enumerate(flags):
        due = not term and (trunc or (t + 1) % 5 == 0)
        assert boot[t] == v_next if due else np.isnan(boot[t]), t
    assert cols["policy_version"][order].tolist() == [0] * 12 + [1] * 11


def test_a_short_fill_ends_and_the_commit_forms_the_rollout(redis_url, workers, namespace):
    """A fill that finds the rollout short ends at once (it holds no worker process while
    the steps come) and leaves the recipe waiting; the ingest commit that completes the
    rollout forms it and pushes its 12 minibatches (the first alone, the rest together),
    each exactly once, with no fill asked after the steps were sent."""
    records: dict = {}
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    reg = Registry(Store(redis_url, namespace))
    reg.put(Recipe.model_validate(recipe()), None)
    got = run_fill(reg, "ppo")
    assert got["made"] == 0 and got["state"].startswith(
        "waiting for rollout of policy_version 0: 0 of 64"
    ), got
    assert reg.r.smembers(reg.rollouts_waiting_key) == {b"ppo"}
    for k in range(4):
        Actor(ing, k, records, seed=k).segment(16, 0)
    ing.flush()  # returns once the commits are confirmed
    queue, deadline = reg.queue("ppo"), time.monotonic() + 60
    while reg.r.llen(queue) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)  # no pop: a pop on an empty queue would ask for a fill
    assert read_state(reg, "ppo").describe() == {
        "rollouts": 1,
        "policy_version": 0,
        "minibatches_pushed": 12,
        "minibatches": 12,
        "dropped_stale": 0,
        "lost": 0,
    }
    assert reg.r.smembers(reg.rollouts_waiting_key) == set()
    client = BatchClient(namespace, redis_url)
    assert len(pop_rollout(client, records, (0, 0))) == 64
    client.close()
    ing.close()


def test_ingest_is_not_starved_while_a_rollout_waits(redis_url, start_worker, namespace):
    """One worker process for ingest and prefetch: the fill forced by registering the
    rollout recipe finds no steps and ends, so the ingest tasks run while the rollout
    waits, and their last commit forms it, in that process (or the module's other
    worker's), with nothing else asked."""
    start_worker("ingest,prefetch", 1)
    records: dict = {}
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    client = BatchClient(namespace, redis_url)
    client.register(recipe())  # its forced fill: 0 of 64 steps
    reg = client.registry
    wait_state(client, "waiting for rollout of policy_version 0: 0 of 64")
    deadline = time.monotonic() + 60
    while reg.r.exists(reg.refill_lock("ppo")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not reg.r.exists(reg.refill_lock("ppo"))  # that fill has ended: nothing waits
    for k in range(4):
        Actor(ing, k, records, seed=30 + k).segment(16, 0)
        ing.flush()  # each segment's ingest task commits while the rollout waits
    deadline = time.monotonic() + 60
    # Formed (``no`` set) comes a moment before its minibatches are pushed: wait for those.
    # No pop before: a pop on an empty queue would ask for a fill. (Three pool processes
    # share the host's index here: the last commit's sweep reads it current, not the
    # columns another process's sweep holds: orchestrator.sampling.shared.)
    while read_state(reg, "ppo").cursor < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_state(reg, "ppo").describe()["minibatches_pushed"] == 12
    assert len(pop_rollout(client, records, (0, 0))) == 64
    client.close()
    ing.close()


def test_advance_moves_the_version_in_one_call_and_the_commit_forms_the_rollout(
    redis_url, workers, namespace
):
    """``advance`` (a learner's next rollout, before its steps are written) moves the
    policy version as ``set_params`` does (the next recipe version, queued minibatches of
    the last one dropped) without a fill: the recipe waits, and the commits of the new
    version's steps form the rollout. Behind another client's change it falls back to
    ``set_params`` (the versions stay one apart)."""
    records: dict = {}
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    client = BatchClient(namespace, redis_url)
    first = client.register(recipe())
    for k in range(4):
        Actor(ing, k, records, seed=50 + k).segment(16, 0)
    ing.flush()
    client.pop("ppo", timeout=60)  # rollout 0: its 11 other minibatches stay queued
    reg = client.registry
    moved = client.advance("ppo", 1)
    assert (moved.version, moved.params["policy_version"]) == (first.version + 1, 1)
    assert reg.get("ppo").recipe == moved and reg.version("ppo") == moved.version
    # Rollout 0's minibatches: dropped (a push of its rest racing the call lands, sees the
    # newer version and takes its items back: the queue empties either way).
    deadline = time.monotonic() + 30
    while reg.r.llen(reg.queue("ppo")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reg.r.llen(reg.queue("ppo")) == 0
    assert reg.r.smembers(reg.rollouts_waiting_key) == {b"ppo"}
    for k in range(4):
        Actor(ing, k, records, seed=60 + k).segment(16, 1)
    ing.flush()
    assert len(pop_rollout(client, records, (1, 1))) == 64
    other = BatchClient(namespace, redis_url)
    other.set_params("ppo", policy_version=2)  # this client's recipe is behind now
    behind = client.advance("ppo", 3)
    assert (behind.version, behind.params["policy_version"]) == (moved.version + 2, 3)
    assert reg.version("ppo") == behind.version
    plain = {"name": "plain", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
    other.register(plain)
    with pytest.raises(ValueError, match="no rollout section"):
        other.advance("plain", 1)
    other.close()
    client.close()
    ing.close()


def test_episode_add_refuses_values_that_overflow_where_they_are_used(
    redis_url, workers, namespace
):
    """The client checks before buffering, in the type each value is used in: rollout tags
    and the reward in float32, other numeric tags in float64; a one-line error names the
    value, and nothing of the refused step is buffered."""
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    ep = ing.episode()
    obs = np.zeros(3, np.float32)
    ok = {"log_prob": -0.5, "value": 0.1}
    for bad, name in (
        ({"value": 1e300}, "tag 'value'"),
        ({"log_prob": -1e39}, "tag 'log_prob'"),
        ({"bootstrap_value": float("inf")}, "tag 'bootstrap_value'"),
        ({"score": 10**400}, "tag 'score'"),
        ({"score": float("inf")}, "tag 'score'"),
    ):
        with pytest.raises(SchemaError, match=name) as e:
            ep.add(obs, np.int64(0), 1.0, **{**ok, **bad})
        assert "\n" not in str(e.value)
    with pytest.raises(SchemaError, match="reward"):
        ep.add(obs, np.int64(0), 1e300, **ok)
    with pytest.raises(SchemaError, match="priority"):
        ep.add(obs, np.int64(0), 1.0, priority=1e39, **ok)
    ep.add(obs, np.int64(0), 1.0, score=1e300, **ok)  # a plain tag is float64: kept
    ep.add(obs, np.int64(0), 1.0, terminated=True, **ok)
    assert ing.close().committed == 2


def test_a_rollout_whose_float32_advantages_overflow_is_dropped_and_counted(
    redis_url, workers, namespace
):
    """The attack: every value sent is finite in float32 (reward and value 3e38), but GAE
    sums them: the advantages and returns of the rollout are past float32's range, and a
    minibatch would carry inf. Such a rollout is not formed: its steps are counted stale,
    nothing is pushed."""
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    reg = Registry(Store(redis_url, namespace))
    reg.put(Recipe.model_validate(recipe()), None)
    obs = np.zeros(3, np.float32)
    big = 3e38  # finite as float32 (max 3.4028e38)
    with ing.episode(policy_version=0) as ep:
        for t in range(64):
            ep.add(obs, np.int64(0), big, terminated=t == 63, log_prob=-0.5, value=big)
    assert ing.flush().committed == 64
    run_fill(reg, "ppo")  # whether the commit's own sweep got to it first or not
    st = read_state(reg, "ppo").describe()
    assert st["rollouts"] == 0 and st["dropped_stale"] == 64, st
    assert reg.r.llen(reg.queue("ppo")) == 0
    ing.close()


def test_labels_and_late_rewards_check_rollout_tags_in_float32(redis_url, workers, namespace):
    """The attack: ingest refuses ``value=1e300``, but a curation label (web, CLI) or a
    late reward's tags write a stored step's tags directly. They check each value in the
    type it is used in too: a rollout tag finite as float32, another tag as float64."""
    ing = Ingestor(namespace, redis_url, schema=Schema.rollout((3,)), flush_interval=None)
    with ing.episode(episode_id="lab") as ep:
        ep.add(np.zeros(3, np.float32), np.int64(0), 1.0, log_prob=-0.5, value=0.1, score=1.0)
    assert ing.flush().committed == 1
    store = Store(redis_url, namespace)
    ids = store.episode("lab", fields=[])["id"]
    for bad in ({"value": 1e300}, {"log_prob": -1e39}, {"value": float("inf")}):
        with pytest.raises(ValueError, match="float32"):
            store.curate(ids, tags=bad)
        with pytest.raises(ValueError, match="float32"):
            store.update_rewards(ids, [1.0], tags=bad)
    assert store.curate(ids, tags={"value": 0.25, "score": 1e300}) == 1
    got = store.episode("lab", fields=[])
    assert got["tags.value"].tolist() == [0.25] and got["tags.score"].tolist() == [1e300]
    ing.close()


def test_a_learner_registering_an_older_version_is_refused_and_nothing_changes(
    redis_url, namespace
):
    """A learner restarting with its recipe's initial params (policy_version 0) while the
    registered one is at 3 would move a rollout recipe's version back, which no fill can
    serve: the registration, and a set_params doing the same, are refused with the way
    out named, and the registered recipe stays as it was."""
    Store(redis_url, namespace).create(1000, schema=Schema.rollout((3,)))
    client = BatchClient(namespace, redis_url)
    client.register(recipe())
    at3 = client.set_params("ppo", policy_version=3)
    restarted = BatchClient(namespace, redis_url)
    with pytest.raises(ValueError, match="policy_version 0 is behind the registered 3"):
        restarted.register(recipe())
    with pytest.raises(ValueError, match="policy_version 1 is behind the registered 3"):
        restarted.set_params("ppo", policy_version=1)
    stored = client.registry.get("ppo").recipe
    assert (stored.version, stored.params["policy_version"]) == (at3.version, 3)
    resumed = restarted.register({**recipe(), "params": {"policy_version": 3}})
    assert resumed.version == at3.version  # the same recipe: kept, nothing dropped
    restarted.close()
    client.close()

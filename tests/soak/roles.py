"""The processes of the chaos soak (tests/soak/soak.py) that are not Claw's own: producers
and a trainer that log what they saw, and the check that compares those logs with the
store at the end. Each runs on a simulated host: ``python -m tests.soak.roles ROLE ...``.

Every line a role logs is a JSON object, written and flushed before the role goes on, so
a log holds everything the role saw even if it is killed."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np


def _log(out: IO[str], **fields: Any) -> None:
    out.write(json.dumps({"t": time.time(), **fields}) + "\n")
    out.flush()


def dropped(out: IO[str], client: Any, error: Exception) -> None:
    """Log a trainer's error, close its client and pause a second: the loop makes a new
    client on its next turn (an outage under test)."""
    _log(out, event="error", error=repr(error)[:200])
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()
    time.sleep(1)


def actor(url: str, ns: str, name: str, log: Path, stop: Path, seed: int) -> None:
    """CartPole episodes with a random policy, each flushed until the store confirms it;
    logs ``confirmed`` per episode (its id and length) only once it is."""
    import gymnasium as gym

    from claw_tasks.client import Ingestor

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    with log.open("a") as out:
        ing = Ingestor(ns, url, flush_interval=None, flush_steps=10**9, resend_after=10)
        k = 0
        while not stop.exists():
            episode = f"{name}-{k}"
            obs, _ = env.reset(seed=int(rng.integers(2**31)))
            n = 0
            with ing.episode(episode_id=episode) as ep:
                done = False
                while not done:
                    action = int(rng.integers(2))
                    nxt, reward, term, trunc, _ = env.step(action)
                    ep.add(np.asarray(obs, np.float32), np.int64(action), float(reward))
                    obs, n, done = nxt, n + 1, term or trunc
            if not _until_confirmed(ing, out, stop, episode=episode):
                return
            _log(out, event="confirmed", episode=episode, steps=n)
            k += 1
        ing.close(timeout=120)


DQN = {
    "name": "dqn",
    "batch_size": 64,
    "fields": ["obs", "action", "reward", "next_obs"],
    "sources": [{"name": "all"}],
    "prefetch": {"depth": 4},
}


def trainer(url: str, ns: str, log: Path, stop: Path) -> None:
    """Pops the replay recipe in a loop; logs each batch (rows, and whether its obs are
    the recipe's shape and finite) or error."""
    _pop_loop(url, ns, log, stop, DQN, _dqn_batch, pause=0.0)


def _dqn_batch(b: Any) -> dict[str, Any]:
    obs = np.asarray(b["obs"])
    whole = obs.shape == (DQN["batch_size"], 4) and bool(np.isfinite(obs).all())
    return {"rows": int(obs.shape[0]), "whole": whole}


PPO = {
    "name": "ppo",
    "batch_size": 16,
    "fields": ["obs", "action"],
    "sources": [{"name": "actors"}],
    "params": {"policy_version": 0},
    "prefetch": {"depth": 8},
    "rollout": {"steps": 64, "epochs": 2, "max_lag": 1},
}


def rollout_actor(url: str, ns: str, name: str, log: Path, stop: Path, seed: int) -> None:
    """Segments of 32 on-policy steps at the recipe's current policy version (each step's
    obs names it: actor, episode, step index, version), flushed until confirmed."""
    from claw_tasks.client import Ingestor
    from orchestrator.delivery.registry import Registry

    rng = np.random.default_rng(seed)
    me = int(seed)
    with log.open("a") as out:
        ing = Ingestor(ns, url, flush_interval=None, flush_steps=10**9, resend_after=10)
        reg = Registry(ing.store)
        version, ep, ep_no, t = 0, None, 0, 0
        while not stop.exists():
            try:
                entry = reg.get("ppo")
                if entry is not None:
                    version = int(entry.recipe.params["policy_version"])
            except Exception as e:  # an outage under test: the last version known
                _log(out, event="version-unknown", error=repr(e)[:200])
            for i in range(32):
                if ep is None:
                    ep_no, t = ep_no + 1, 0
                    ep = ing.episode(episode_id=f"{name}-rollout-{ep_no}")
                term = bool(rng.random() < 0.05)
                tags = {"log_prob": float(-rng.random()), "value": float(rng.normal())}
                if i == 31 and not term:
                    tags["bootstrap_value"] = float(rng.normal())
                key = np.array([me, ep_no, t, version], np.float32)
                ep.add(key, np.int64(i % 2), float(rng.normal()), terminated=term,
                       policy_version=version, **tags)  # fmt: skip
                t += 1
                if term:
                    ep.end()
                    ep = None
            if not _until_confirmed(ing, out, stop):
                return
            _log(out, event="confirmed", steps=32, version=version)
        ing.close(timeout=120)


def ppo_trainer(url: str, ns: str, log: Path, stop: Path) -> None:
    """Pops the rollout recipe's minibatches; after a rollout's last one moves the policy
    version on. Logs each minibatch's place and the steps it holds."""
    from orchestrator import BatchClient

    with log.open("a") as out:
        client = None
        while not stop.exists():
            try:
                if client is None:  # a learner resumes at the registered version
                    client = BatchClient(ns, url)
                    entry = client.registry.get("ppo")
                    version = 0 if entry is None else entry.recipe.params["policy_version"]
                    client.register({**PPO, "params": {"policy_version": version}})
                try:
                    b = client.pop("ppo", timeout=10)
                except TimeoutError:  # a learner killed after its rollout's last pop and
                    # before its advance: the rollout is served whole, so move on from it
                    ro_state = client.stats("ppo")["ppo"].get("rollout") or {}
                    total = ro_state.get("minibatches")
                    if total and ro_state.get("minibatches_pushed") == total:
                        client.advance("ppo", int(ro_state["policy_version"]) + 1)
                        _log(out, event="advanced", to=int(ro_state["policy_version"]) + 1)
                    continue
                ro = b.meta["rollout"]
                keys = np.asarray(b["obs"]).astype(np.int64).tolist()
                _log(out, event="minibatch", no=ro["no"], target=ro["policy_version"],
                     epoch=ro["epoch"], minibatch=ro["minibatch"], keys=keys)  # fmt: skip
                last = (ro["epochs"] - 1, ro["minibatches"] - 1)
                if (ro["epoch"], ro["minibatch"]) == last:
                    client.advance("ppo", ro["policy_version"] + 1)
                    _log(out, event="advanced", to=ro["policy_version"] + 1)
            except Exception as e:  # an outage under test: a new client next time
                client = dropped(out, client, e)
        if client is not None:
            client.close()


def check_rollouts(log: Path) -> dict[str, Any]:
    """No minibatch served twice, no step in two rollouts, every step of a rollout within
    its version window, and every rollout's epochs the same steps."""
    seen: set[tuple[int, int, int]] = set()
    rollout_of: dict[tuple[int, ...], int] = {}
    epochs: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    problems: list[str] = []
    minibatches = 0
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] != "minibatch":
            continue
        minibatches += 1
        place = (rec["no"], rec["epoch"], rec["minibatch"])
        if place in seen:
            problems.append(f"minibatch {place} served twice")
        seen.add(place)
        lo, hi = rec["target"] - PPO["rollout"]["max_lag"], rec["target"]
        for key in map(tuple, rec["keys"]):
            if not lo <= key[3] <= hi:
                problems.append(f"step {key} of version {key[3]} in rollout {rec['no']} of {hi}")
            step = key[:3]
            if rollout_of.setdefault(step, rec["no"]) != rec["no"]:
                problems.append(f"step {step} in rollouts {rollout_of[step]} and {rec['no']}")
            epochs.setdefault((rec["no"], rec["epoch"]), set()).add(step)
    for (no, epoch), steps in epochs.items():
        first = epochs.get((no, 0))
        complete = len(steps) == PPO["rollout"]["steps"] and first is not None
        if complete and len(first) == len(steps) and first != steps:
            problems.append(f"rollout {no}: epoch {epoch} holds other steps than epoch 0")
    return {
        "rollouts": len({no for no, _ in epochs}),
        "minibatches": minibatches,
        "problems": problems[:20],
        "n_problems": len(problems),
    }


def _until_confirmed(ing: Any, out: IO[str], stop: Path, **fields: Any) -> bool:
    """Flush ``ing`` until the store confirms (the batch stays in flight and is re-sent);
    False once the stop file is two minutes old."""
    while True:
        try:
            ing.flush(timeout=20)
            return True
        except Exception as e:  # an outage under test
            _log(out, event="unconfirmed", error=repr(e)[:200], **fields)
            if _stopped_long_ago(stop):
                return False


def _stopped_long_ago(stop: Path) -> bool:
    """The stop file is two minutes old: a producer still failing gives up."""
    return stop.exists() and stop.stat().st_mtime + 120 < time.time()


def marl_actor(url: str, ns: str, name: str, log: Path, stop: Path, seed: int) -> None:
    """PettingZoo joint steps (tests/support/marlenv.py's Crowd: agents die and join)
    through RecordParallelSteps, an episode at a time, flushed until confirmed. Logs each
    episode's joint steps (``recorded``: per step t the agents that acted, as a bit mask)
    before its flush, and ``confirmed`` after."""
    from claw_tasks.client import Ingestor
    from claw_tasks.client.pettingzoo import RecordParallelSteps
    from tests.support.marlenv import Crowd

    env = Crowd(seed=seed)
    rng = np.random.default_rng(seed)
    with log.open("a") as out:
        ing = Ingestor(ns, url, flush_interval=None, flush_steps=10**9, resend_after=10)
        rec = RecordParallelSteps(env, ing, task_id="crowd")
        while not stop.exists():
            rec.reset()
            episode, masks = rec.episode_id, []
            while rec.agents:
                acting = list(rec.agents)
                masks.append(sum(1 << AGENTS.index(a) for a in acting))
                rec.step({a: int(rng.integers(3)) for a in acting})
            _log(out, event="recorded", episode=episode, masks=masks)
            if not _until_confirmed(ing, out, stop, episode=episode):
                return
            _log(out, event="confirmed", episode=episode, steps=len(masks))
            time.sleep(0.2)  # a small rate: the soak is about faults, not throughput
        ing.close(timeout=120)


AGENTS = ["a0", "a1", "a2", "a3"]
JOINT = {
    "name": "joint",
    "batch_size": 16,
    "fields": ["obs", "action", "step_index", "episode_id"],
    "sources": [{"name": "all", "sampler": {"kind": "recent"}}],
    "joint": {"agents": AGENTS},
    "prefetch": {"depth": 2},
}


def joint_rows(b: Any) -> tuple[list[list[Any]], int]:
    """Each row of joint batch ``b`` as [env episode, t, agent mask], and how many rows
    are misaligned: agents of another joint step, another episode, or in another agent's
    slot (Crowd's observation names its episode, step and agent: [episode, t, i, noise])."""
    obs, mask = np.asarray(b["obs"]), np.asarray(b["mask"], bool)
    steps = np.asarray(b["step_index"])
    rows, bad = [], 0
    for i, eps in enumerate(b.meta["episode_id"]):
        present = np.flatnonzero(mask[i])
        j = int(present[0])
        key = eps[j].rsplit("/", 1)[0]
        names = {eps[k].rsplit("/", 1)[0] for k in present.tolist()}
        o = obs[i, present]
        aligned = (
            names == {key}
            and (steps[i, present] == steps[i, j]).all()
            and (o[:, 1] == steps[i, j]).all()
            and (o[:, 0] == o[0, 0]).all()
            and (o[:, 2] == present).all()
        )
        bad += not aligned
        rows.append([key, int(steps[i, j]), int(sum(1 << k for k in present.tolist()))])
    return rows, bad


def joint_trainer(url: str, ns: str, log: Path, stop: Path) -> None:
    """Pops the joint recipe in a loop; logs each batch's rows (env episode, t, agents
    present) and how many were misaligned, or the error."""
    _pop_loop(url, ns, log, stop, JOINT, _joint_batch, pause=0.2)


def _joint_batch(b: Any) -> dict[str, Any]:
    rows, bad = joint_rows(b)
    return {"rows": rows, "misaligned": bad, "partial": int(b.meta["joint"]["partial"])}


def _pop_loop(
    url: str, ns: str, log: Path, stop: Path, recipe: dict, seen: Any, pause: float
) -> None:
    """Register ``recipe`` and pop it until stopped, ``pause`` seconds between pops,
    logging ``batch`` with what ``seen(batch)`` reports, or ``error`` (then a new
    client)."""
    from orchestrator import BatchClient

    with log.open("a") as out:
        client = None
        while not stop.exists():
            try:
                if client is None:
                    client = BatchClient(ns, url)
                    client.register(recipe)
                b = client.pop(recipe["name"], timeout=10)
                _log(out, event="batch", **seen(b))
                time.sleep(pause)
            except Exception as e:  # an outage under test: a new client next time
                client = dropped(out, client, e)
        if client is not None:
            client.close()


def check_joint(actor_logs: list[Path], trainer_log: Path) -> dict[str, Any]:
    """Every served joint row aligned (its agents share the episode and step, each in its
    own slot) and whole: the agents it holds are the agents that acted at that step."""
    acted: dict[tuple[str, int], int] = {}
    confirmed = 0
    for path in actor_logs:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "recorded":
                for t, m in enumerate(rec["masks"]):
                    acted[(rec["episode"], t)] = m
            confirmed += rec["event"] == "confirmed"
    problems: list[str] = []
    batches = rows = 0
    for line in trainer_log.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] != "batch":
            continue
        batches += 1
        rows += len(rec["rows"])
        if rec["misaligned"]:
            problems.append(f"a joint batch with {rec['misaligned']} misaligned rows")
        for episode, t, m in rec["rows"]:
            want = acted.get((episode, t))
            if want is None:
                problems.append(f"joint row {episode}/{t} was never recorded")
            elif want != m:
                problems.append(f"partial joint row {episode}/{t}: agents {m:04b} of {want:04b}")
    return {
        "confirmed_episodes": confirmed,
        "batches": batches,
        "rows": rows,
        "problems": problems[:20],
        "n_problems": len(problems),
    }


TURNS, GROUP_SIZE = 2, 2
ASK = [{"role": "user", "content": "hello"}]
STALENESS = 1
GRPO = {
    "name": "grpo",
    "batch_size": 2,
    "fields": ["response_ids", "policy_version"],
    "params": {"policy_version": 0},
    "admission": {"max_staleness": STALENESS},
    "prefetch": {"depth": 1},
    "sources": [
        {
            "name": "rollouts",
            "sampler": {"kind": "group", "group_size": GROUP_SIZE, "once": True, "passes": 1},
        }
    ],
}
FINAL_REWARD, CALL_REWARD = 1.0, 0.25
"""What every agent posts: the final reward and a reward per call (by its call id)."""
TRAJECTORIES = GRPO["batch_size"] * GROUP_SIZE
"""Trajectories per GRPO batch (B of the admission budget)."""


def llm_actor(url: str, ns: str, name: str, log: Path, stop: Path, seed: int, gw: str) -> None:
    """Groups of ``GROUP_SIZE`` trajectories of ``TURNS`` chat calls each through the
    capture gateway at ``gw`` with the ``openai`` client, then each trajectory's reward by
    the call ids it was answered with. Logs ``answered`` per call (its id) and ``rewarded``
    once a reward is taken (``reward-refused`` when the gateway refuses it, e.g. a turn it
    answered and lost, or when 60 posts got no answer)."""
    import httpx
    import openai

    from tests.support.gateway import REWARD_TOKEN, TOKEN

    llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=TOKEN, max_retries=0, timeout=30)
    # Longer than a reward's own waits in the gateway (its calls recorded, flushed and
    # committed: 60 s each at most), so a refusal arrives rather than a client timeout.
    scorer = httpx.Client(timeout=200, headers={"Authorization": f"Bearer {REWARD_TOKEN}"})

    with log.open("a") as out:
        g = 0
        while not stop.exists():
            group = f"{name}-{seed}-g{g}"
            for j in range(GROUP_SIZE):
                traj = f"{group}-{j}"
                ids = {"X-Claw-Trajectory": traj, "X-Claw-Group": group}
                calls: list[str] = []
                while len(calls) < TURNS:
                    try:
                        raw = llm.chat.completions.with_raw_response.create(
                            model="sim", messages=ASK, extra_headers=ids
                        )
                        calls.append(raw.headers["x-claw-call-id"])
                        _log(out, event="answered", trajectory=traj, call=calls[-1])
                    except Exception as e:  # a 429 over the budget, or an outage under test
                        _log(out, event="call-failed", trajectory=traj, error=repr(e)[:200])
                        if _stopped_long_ago(stop):
                            return
                        time.sleep(0.5)
                body = {
                    "final_reward": FINAL_REWARD,
                    "call_rewards": dict.fromkeys(calls, CALL_REWARD),
                }
                for _ in range(60):
                    try:
                        r = scorer.post(f"{gw}/t/{traj}/reward", json=body)
                    except httpx.HTTPError as e:  # an outage under test: post it again
                        _log(out, event="reward-failed", trajectory=traj, error=repr(e)[:200])
                        time.sleep(1)
                        continue
                    if r.status_code == 200:
                        _log(out, event="rewarded", trajectory=traj, calls=calls)
                    elif r.status_code < 500 and r.status_code != 429:
                        _log(out, event="reward-refused", trajectory=traj, status=r.status_code,
                             error=r.text[:300])  # fmt: skip
                    else:
                        _log(out, event="reward-failed", trajectory=traj, error=r.text[:200])
                        time.sleep(1)
                        continue
                    break
                else:  # never answered: counted with the refusals
                    _log(out, event="reward-refused", trajectory=traj, status=0,
                         error="no answer to 60 posts")  # fmt: skip
            g += 1
            time.sleep(0.2)


def grpo_trainer(url: str, ns: str, log: Path, stop: Path) -> None:
    """The GRPO learner: pops whole groups at its policy version v, then declares v + 1
    (``set_params``: the gateways' admission budget grows). Logs each batch (its
    trajectories and rows' versions, and v) or the error."""
    from orchestrator import BatchClient

    with log.open("a") as out:
        client, v, popped = None, 0, False
        while not stop.exists():
            try:
                if client is None:
                    client = BatchClient(ns, url)
                    entry = client.registry.get("grpo")
                    if entry is None:
                        client.register(GRPO)
                    was = v
                    v = int(client.registry.registered("grpo").recipe.params["policy_version"])
                    popped = popped and v == was  # declared already, its reply lost
                if not popped:
                    b = client.pop("grpo", timeout=10, policy_version=v)
                    versions = np.asarray(b["policy_version"])
                    n = len(np.unique(np.asarray(b["trajectory_index"])))
                    _log(out, event="batch", v=v, oldest=int(versions.min()), trajectories=n)
                    popped = True
                client.set_params("grpo", policy_version=v + 1)
                v, popped = v + 1, False
                _log(out, event="declared", v=v)
            except TimeoutError:
                continue
            except Exception as e:  # an outage under test: a new client next time
                client = dropped(out, client, e)
        if client is not None:
            client.close()


def check_grpo(log: Path) -> dict[str, Any]:
    """No served row older than v - max_staleness; the batches and versions seen."""
    problems: list[str] = []
    batches, v = 0, 0
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "batch":
            batches += 1
            if rec["oldest"] < rec["v"] - STALENESS:
                problems.append(f"a batch at v {rec['v']} holds a turn of version {rec['oldest']}")
        elif rec["event"] == "declared":
            v = rec["v"]
    return {"batches": batches, "version": v, "problems": problems[:20],
            "n_problems": len(problems)}  # fmt: skip


def check_llm(url: str, ns: str, logs: list[Path], batches: int, out: Path) -> None:
    """From the store, at the end (every agent and the learner stopped): every turn of a
    rewarded trajectory recorded exactly once (each call id it was answered with on one
    stored turn, no call id or turn index twice, the reward on every turn); then the
    version moved past every unserved trajectory, the admission count equals the slots
    of the ``batches`` trained on (none leaked)."""
    from claw_tasks.format.arrays import unpackb
    from claw_tasks.format.stepmeta import episode_code
    from claw_tasks.store import Store
    from orchestrator import BatchClient
    from orchestrator.delivery import admission

    store = Store(url, ns)
    rewarded: dict[str, tuple[list[str], float]] = {}
    answered = 0
    answers: dict[str, list[float]] = {}
    refused: dict[str, dict[str, Any]] = {}
    for path in logs:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "rewarded":
                rewarded[rec["trajectory"]] = (rec["calls"], rec["t"])
            if rec["event"] == "answered":
                answered += 1
                answers.setdefault(rec["trajectory"], []).append(rec["t"])
            elif rec["event"] == "reward-refused":  # with when each of its turns was answered
                at = answers.get(rec["trajectory"], [rec["t"]])
                refused[rec["trajectory"]] = {"answered_at": at, "error": rec["error"]}
    ids_of: dict[int, list[int]] = {}
    cfg = store.config()
    for shard in range(cfg.n_shards):
        cols = store.meta_columns(shard, ["episode", "id"])
        live = cols["alive"]
        for code, i in zip(cols["episode"][live].tolist(), cols["id"][live].tolist(), strict=True):
            ids_of.setdefault(code, []).append(i)
    problems: list[str] = []
    missing: dict[str, float] = {}
    turns = extra = 0
    for traj, (calls, t) in rewarded.items():
        ids = ids_of.get(episode_code(traj), [])
        if not ids:
            missing[traj] = t
            continue
        got = store.get(ids, [])
        shards, slots = store.locate(np.asarray(ids, np.int64))
        info = [unpackb(x) if x else {} for x in store.read_info(shards, slots)]
        stored = [i.get("call_id") for i in info]
        turns += len(stored)
        extra += len(set(stored) - set(calls))
        if len(set(got["step_index"].tolist())) != len(ids) or len(set(stored)) != len(ids):
            problems.append(f"{traj}: a turn stored twice ({sorted(got['step_index'].tolist())})")
        lost = [c for c in calls if c not in stored]
        if lost:
            missing[traj] = t
        final = np.asarray(got["tags.final_reward"], float)
        if np.isnan(final).any():
            problems.append(f"{traj}: a turn without its reward")
        elif (final != FINAL_REWARD).any():
            problems.append(f"{traj}: a turn with another reward {sorted(set(final.tolist()))}")
        elif not lost and not np.isclose(
            float(np.sum(got["reward"])), CALL_REWARD * len(calls) + FINAL_REWARD
        ):
            problems.append(f"{traj}: turn rewards {got['reward'].tolist()} are not the posted")
    # No leaked admission slots: with every agent stopped, the version moved past every
    # rewarded, unserved trajectory (they lapse) and the queued batch dropped (given back),
    # what stays admitted is what was trained on.
    client = BatchClient(ns, url)
    v = int(client.registry.registered("grpo").recipe.params["policy_version"])
    client.set_params("grpo", policy_version=v + STALENESS + 1)
    deadline = time.time() + 120  # open trajectories expire (the gateway's sweep)
    while True:
        state = admission.state(store)
        assert state is not None
        if (state["open"] == 0 and state["waiting"] == 0) or time.time() > deadline:
            break
        time.sleep(1)
    client.close()
    result = {
        "answered_calls": answered,
        "rewarded_trajectories": len(rewarded),
        "refused_rewards": refused,
        "turns_of_rewarded": turns,
        "unanswered_turns": extra,
        "missing": sorted(missing),
        "missing_at": missing,
        "problems": problems[:20],
        "n_problems": len(problems),
        "admission": {k: state[k] for k in ("admitted", "budget", "open", "waiting", "total",
                                            "released", "expired", "lapsed", "version")},
        "trained_slots": batches * TRAJECTORIES,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2))


def nearest_queries(url: str, ns: str, log: Path, stop: Path, seed: int) -> None:
    """``nearest()`` against the replay namespace's vector index (built by the beat) about
    once a second, each answer checked at once: every returned id is stored (not evicted)
    and its stored obs lies at the distance the index gave. Logs ``answer`` (ids returned,
    problems) or ``error``."""
    from claw_tasks.store import Store
    from orchestrator import nearest

    rng = np.random.default_rng(seed)
    store = Store(url, ns)
    with log.open("a") as out:
        while not stop.exists():
            q = rng.normal(0, 0.1, (4, 4)).astype(np.float32)
            try:
                got = nearest(ns, q, 5, redis_url=url)
                found = got.ids[got.ids > 0]
                problems: list[str] = []
                if len(found):
                    try:
                        obs = np.asarray(store.get(found, ["obs"])["obs"], np.float64)
                    except KeyError as e:  # evicted before this read, or never stored
                        problems.append(str(e)[:200])
                    else:
                        rows = np.nonzero(got.ids > 0)
                        want = ((q[rows[0]].astype(np.float64) - obs) ** 2).sum(axis=1)
                        d = got.distances[rows]
                        if not np.allclose(d, want, rtol=1e-3, atol=1e-4):
                            problems.append(f"distances {d[:3]} for obs at {want[:3]}")
                _log(out, event="answer", ids=len(found), problems=problems)
            except Exception as e:  # an outage under test, or no index built yet
                _log(out, event="error", error=repr(e)[:200])
            time.sleep(1)


def check_nearest(log: Path) -> dict[str, Any]:
    answers, problems = 0, []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "answer":
            answers += rec["ids"] > 0
            problems += rec["problems"]
    return {"answers": answers, "problems": problems[:20], "n_problems": len(problems)}


def check(url: str, ns: str, logs: list[Path], archive: Path, out: Path) -> None:
    """Every episode an actor saw confirmed is whole in the store and the archive together,
    no step of it stored twice; the archive holds no step twice."""
    from claw_tasks.format.stepmeta import episode_code
    from claw_tasks.store import Store

    store = Store(url, ns)
    confirmed: dict[str, int] = {}
    for path in logs:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "confirmed":
                confirmed[rec["episode"]] = rec["steps"]
    # Every shard's metadata columns once (not a read per episode): per episode code, the
    # step indexes of its live steps; then the archive's (a step the ring evicted must have
    # been archived first: archival runs every minute, the ring holds many more).
    in_store: dict[int, list[int]] = {}
    for shard in range(store.config().n_shards):
        cols = store.meta_columns(shard, ["episode", "step_index"])
        live = cols["alive"]
        for code, step in zip(
            cols["episode"][live].tolist(), cols["step_index"][live].tolist(), strict=True
        ):
            in_store.setdefault(code, []).append(step)
    in_archive: dict[int, set[int]] = {}
    archived, archive_doubles = 0, 0
    ns_dir = archive / f"ns={ns}"  # the archive holds every namespace, each in its own
    files = sorted(ns_dir.rglob("*.parquet")) if ns_dir.is_dir() else []
    if files:
        import pyarrow as pa
        import pyarrow.parquet as pq

        names = ["id", "episode_id", "step_index"]
        table = pa.concat_tables([pq.read_table(f, columns=names) for f in files])
        archived = table.num_rows
        archive_doubles = archived - len(np.unique(table["id"].to_numpy()))
        for name, step in zip(
            table["episode_id"].to_pylist(), table["step_index"].to_pylist(), strict=True
        ):
            in_archive.setdefault(episode_code(name), set()).add(step)
    missing, partial, doubled = [], [], []
    stored = 0
    for episode, n in confirmed.items():
        code = episode_code(episode)
        steps = in_store.get(code, [])
        stored += len(steps)
        if len(steps) != len(set(steps)):
            doubled.append(episode)
        have = set(steps) | in_archive.get(code, set())
        if not have:
            missing.append(episode)
        elif have != set(range(n)):
            partial.append(episode)
    total = store.count()
    dead, letters = store.dead_letters(5)
    result = {
        "confirmed_episodes": len(confirmed),
        "confirmed_steps": sum(confirmed.values()),
        "stored_steps_of_confirmed": stored,
        "stored_steps": total,
        "missing": missing,
        "n_missing": len(missing),
        "partial": partial,
        "n_partial": len(partial),
        "doubled": doubled[:20],
        "n_doubled": len(doubled),
        "archived_rows": archived,
        "archive_doubles": archive_doubles,
        "dead_letters": dead,
        "dead_letter_reasons": sorted(
            {str(fields.get(b"reason", b"?"), "utf-8", "replace") for _, fields in letters}
        ),
    }
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.soak.roles")
    sub = p.add_subparsers(dest="role", required=True)
    named = ("actor", "rollout-actor", "marl-actor", "llm-actor")
    for role in (*named, "trainer", "ppo-trainer", "joint-trainer", "grpo-trainer", "nearest"):
        r = sub.add_parser(role)
        for arg in ("url", "ns", *(("name",) if role in named else ())):
            r.add_argument(arg)
        r.add_argument("log", type=Path)
        r.add_argument("stop", type=Path)
        if role in (*named, "nearest"):
            r.add_argument("seed", type=int)
        if role == "llm-actor":
            r.add_argument("gateway")
    c = sub.add_parser("check")
    c.add_argument("url")
    c.add_argument("ns")
    c.add_argument("archive", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("logs", type=Path, nargs="+")
    c = sub.add_parser("check-llm")
    c.add_argument("url")
    c.add_argument("ns")
    c.add_argument("batches", type=int)
    c.add_argument("out", type=Path)
    c.add_argument("logs", type=Path, nargs="+")
    a = p.parse_args(argv)
    if a.role == "actor":
        actor(a.url, a.ns, a.name, a.log, a.stop, a.seed)
    elif a.role == "rollout-actor":
        rollout_actor(a.url, a.ns, a.name, a.log, a.stop, a.seed)
    elif a.role == "marl-actor":
        marl_actor(a.url, a.ns, a.name, a.log, a.stop, a.seed)
    elif a.role == "llm-actor":
        llm_actor(a.url, a.ns, a.name, a.log, a.stop, a.seed, a.gateway)
    elif a.role == "ppo-trainer":
        ppo_trainer(a.url, a.ns, a.log, a.stop)
    elif a.role == "trainer":
        trainer(a.url, a.ns, a.log, a.stop)
    elif a.role == "joint-trainer":
        joint_trainer(a.url, a.ns, a.log, a.stop)
    elif a.role == "grpo-trainer":
        grpo_trainer(a.url, a.ns, a.log, a.stop)
    elif a.role == "nearest":
        nearest_queries(a.url, a.ns, a.log, a.stop, a.seed)
    elif a.role == "check-llm":
        check_llm(a.url, a.ns, a.logs, a.batches, a.out)
    else:
        check(a.url, a.ns, a.logs, a.archive, a.out)


if __name__ == "__main__":
    sys.exit(main())

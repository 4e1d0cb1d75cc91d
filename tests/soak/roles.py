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
            while True:  # until confirmed: the batch stays in flight and is re-sent
                try:
                    ing.flush(timeout=20)
                    break
                except Exception as e:  # an outage under test
                    _log(out, event="unconfirmed", episode=episode, error=repr(e)[:200])
                    if stop.exists() and (stop.stat().st_mtime + 120 < time.time()):
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
    """Pops the replay recipe in a loop; logs each batch (rows) or error."""
    from orchestrator import BatchClient

    with log.open("a") as out:
        client = None
        while not stop.exists():
            try:
                if client is None:
                    client = BatchClient(ns, url)
                    client.register(DQN)
                b = client.pop("dqn", timeout=10)
                obs = np.asarray(b["obs"])
                if obs.shape != (64, 4) or not np.isfinite(obs).all():
                    _log(out, event="bad-batch", shape=list(obs.shape))
                _log(out, event="batch", rows=int(obs.shape[0]))
            except Exception as e:  # an outage under test: a new client next time
                _log(out, event="error", error=repr(e)[:200])
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
                    client = None
                time.sleep(1)
        if client is not None:
            client.close()


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
            while True:
                try:
                    ing.flush(timeout=20)
                    break
                except Exception as e:  # an outage under test
                    _log(out, event="unconfirmed", error=repr(e)[:200])
                    if stop.exists() and (stop.stat().st_mtime + 120 < time.time()):
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
                _log(out, event="error", error=repr(e)[:200])
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
                    client = None
                time.sleep(1)
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
    for role, named in (("actor", True), ("rollout-actor", True), ("trainer", False),
                        ("ppo-trainer", False)):  # fmt: skip
        r = sub.add_parser(role)
        for arg in ("url", "ns", *(("name",) if named else ())):
            r.add_argument(arg)
        r.add_argument("log", type=Path)
        r.add_argument("stop", type=Path)
        if named:
            r.add_argument("seed", type=int)
    c = sub.add_parser("check")
    c.add_argument("url")
    c.add_argument("ns")
    c.add_argument("archive", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("logs", type=Path, nargs="+")
    args = p.parse_args(argv)
    if args.role == "actor":
        actor(args.url, args.ns, args.name, args.log, args.stop, args.seed)
    elif args.role == "rollout-actor":
        rollout_actor(args.url, args.ns, args.name, args.log, args.stop, args.seed)
    elif args.role == "ppo-trainer":
        ppo_trainer(args.url, args.ns, args.log, args.stop)
    elif args.role == "trainer":
        trainer(args.url, args.ns, args.log, args.stop)
    else:
        check(args.url, args.ns, args.logs, args.archive, args.out)


if __name__ == "__main__":
    sys.exit(main())

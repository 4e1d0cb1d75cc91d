"""Asynchronous GRPO through the capture gateway at staleness bounds 1, 2 and 4: whether
updates/s stays steady from the first to the last quarter of a run (slots that leak throttle
generation over time), and what the admission counters show.

    .venv/bin/python bench/admission.py [--updates 32] [--threads 32] [--train-s 0.3]

Starts a private redis-server, one worker on ``ingest,prefetch`` (prefork, concurrency 2),
the vLLM-like test upstream and two ``claw gateway`` processes per bound. ``--threads``
agent threads take trajectories of 1 to 16 turns (uniform), in groups of 4, call through
the two gateways alternately with the ``openai`` client and post the reward. A trainer
(a ``BatchClient``) pops group batches of 2 groups (``once``, one pass, oldest first),
spends ``--train-s`` on each update, then declares the next version to the upstream and
with ``set_params``. Per bound: updates/s over the first and the last quarter of the
updates, the trained against the generated mean length (turns), and the counters.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.connection.server import RedisServer
from orchestrator import BatchClient
from tests.support.gateway import (
    REWARD_TOKEN,
    TOKEN,
    Proc,
    start_gateway,
    start_upstream,
    train_tokenizer,
)
from tests.support.processes import Worker

GROUPS, GROUP_SIZE = 2, 4
ASK = [{"role": "user", "content": "hello"}]


def recipe(name: str, staleness: int) -> dict:
    return {
        "name": name,
        "batch_size": GROUPS,
        "fields": ["response_ids", "policy_version"],
        "params": {"policy_version": 0},
        "admission": {"max_staleness": staleness},
        "prefetch": {"depth": 1},
        "sources": [
            {
                "name": "rollouts",
                "where": "tags.min_version >= $min_version",
                "sampler": {"kind": "group", "group_size": GROUP_SIZE, "once": True, "passes": 1},
            }
        ],
    }


def agent(gws: list[Proc], work: queue.Queue, stop: threading.Event, done: list) -> None:
    clients = [openai.OpenAI(base_url=f"{g.url}/v1", api_key=TOKEN, max_retries=0) for g in gws]
    reward = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {REWARD_TOKEN}"})
    while not stop.is_set():
        traj, group, turns = work.get()
        ids = {"X-Claw-Trajectory": traj, "X-Claw-Group": group}
        try:
            for turn in range(turns):
                while not stop.is_set():
                    try:
                        clients[turn % 2].chat.completions.create(
                            model="sim", messages=ASK, extra_headers=ids
                        )
                        break
                    except openai.RateLimitError:
                        continue
            if stop.is_set():
                return
            r = reward.post(f"{gws[0].url}/t/{traj}/reward", json={"final_reward": 1.0})
            if r.status_code == 200:
                done.append(turns)
        except Exception:
            continue


def run(server: RedisServer, upstream: Proc, tmp: Path, s: int, args: argparse.Namespace) -> dict:
    ns = f"bench-adm-s{s}-{uuid.uuid4().hex[:4]}"
    extra = ("--admission-wait", "2", "--retry-after", "0.05", "--max-turns", "1000")
    gws = [start_gateway(upstream.url, ns, tmp, *extra, redis_url=server.url) for _ in range(2)]
    rng = np.random.default_rng(s)
    work: queue.Queue = queue.Queue()
    for g in range(100_000 // GROUP_SIZE):
        for j in range(GROUP_SIZE):
            work.put((f"g{g}-{j}", f"g{g}", int(rng.integers(1, 17))))
    httpx.post(upstream.url + "/_version", json={"version": 0})
    stop, done = threading.Event(), []
    client = BatchClient(ns, server.url)
    name = "grpo"
    client.register(recipe(name, s))
    agents = [
        threading.Thread(target=agent, args=(gws, work, stop, done), daemon=True)
        for _ in range(args.threads)
    ]
    for a in agents:
        a.start()
    pops, trained = [], []
    try:
        for v in range(args.updates):
            batch = client.pop(name, timeout=600, policy_version=v)
            pops.append(time.monotonic())
            t = np.asarray(batch["trajectory_index"])
            trained += np.bincount(t - t.min()).tolist()
            time.sleep(args.train_s)  # the trainer's step
            httpx.post(upstream.url + "/_version", json={"version": v + 1})
            client.set_params(name, policy_version=v + 1)
        st = client.stats(name)[name]
    finally:
        stop.set()
        client.unregister(name)
        client.close()
        for g in gws:
            g.stop()
    q = max(2, len(pops) // 4)
    first = (q - 1) / (pops[q - 1] - pops[0])
    last = (q - 1) / (pops[-1] - pops[-q])
    return {"s": s, "first": first, "last": last, "stats": st, "trained": trained, "gen": done}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=32)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--train-s", type=float, default=0.3)
    ap.add_argument("--bounds", default="1,2,4")
    args = ap.parse_args()
    tmp = Path(f"/tmp/claw-bench-admission-{uuid.uuid4().hex[:6]}")
    tmp.mkdir()
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    results = []
    with RedisServer() as server:
        worker = Worker(server.url, "ingest,prefetch", 2, tmp / "worker.log", {})
        upstream = start_upstream(tokenizer, tmp / "upstream.log")
        try:
            for s in (int(b) for b in args.bounds.split(",")):
                results.append(run(server, upstream, tmp, s, args))
        finally:
            upstream.stop()
            worker.stop()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}; {args.updates} updates, {args.threads} agents, "
        f"train {args.train_s} s"
    )
    for r in results:
        adm = r["stats"]["admission"]
        served = adm.get("served_staleness") or {}
        print(
            f"max_staleness {r['s']}: updates/s first quarter {r['first']:.2f}, last quarter "
            f"{r['last']:.2f} (ratio {r['last'] / r['first']:.2f}); mean turns generated "
            f"{np.mean(r['gen']):.2f}, trained {np.mean(r['trained']):.2f}; admitted "
            f"{adm['admitted']} of budget {adm['budget']}, open {adm['open']}, waiting "
            f"{adm.get('waiting')}, released {adm['released']} slots, lapsed {adm.get('lapsed')}, "
            f"expired {adm['expired']}; served staleness mean {served.get('mean')}, max "
            f"{served.get('max')}"
        )
        print(f"  rewarded by turns {adm.get('rewarded_by_turns')}")
        print(f"  stale by turns    {adm.get('stale_by_turns')}")


if __name__ == "__main__":
    main()

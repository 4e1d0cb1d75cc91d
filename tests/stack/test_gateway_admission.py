"""Staleness-bounded admission across two gateway processes: a fake trainer (a real
BatchClient popping group batches made by a real prefetch worker, declaring each new
policy version with set_params and to the upstream, as a trainer syncing weights to vLLM
would) against 64 agent threads that call through both gateways with the `openai` client.
For max_staleness 0, 1 and 4: the admission log (one Redis stream, written by the script
that admits) never shows a trajectory started past (max_staleness + v + 1) x batch, the
budget is one across both processes, and no served group holds a turn older than
v - max_staleness."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from typer.testing import CliRunner

from claw_tasks.store import Store
from orchestrator import BatchClient
from orchestrator.cli.main import app
from orchestrator.delivery import admission
from tests.support.gateway import (
    REWARD_TOKEN,
    TOKEN,
    Proc,
    start_gateway,
    start_upstream,
    train_tokenizer,
)

THREADS = 64
UPDATES = 3
GROUPS, GROUP_SIZE = 2, 4  # per batch: 8 trajectories
BATCH = GROUPS * GROUP_SIZE
TURNS = 2
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def setup(redis_server, workers, tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("admission")
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    upstream = start_upstream(tokenizer, tmp / "upstream.log")
    namespace = f"adm-{uuid.uuid4().hex[:8]}"
    procs: list[Proc] = []

    def start() -> None:
        extra = ("--admission-wait", "2", "--retry-after", "0.05")
        procs.append(
            start_gateway(upstream.url, namespace, tmp, *extra, redis_url=redis_server.url)
        )

    starting = [threading.Thread(target=start) for _ in range(2)]
    for t in starting:
        t.start()
    for t in starting:
        t.join()
    assert len(procs) == 2, "a gateway did not start (see the logs in the test's tmp dir)"
    yield {"upstream": upstream, "gateways": procs, "namespace": namespace, "url": redis_server.url}
    for p in procs:
        p.stop()
    upstream.stop()


def recipe(name: str, staleness: int, v0: int) -> dict:
    return {
        "name": name,
        "batch_size": GROUPS,
        "fields": ["response_ids", "policy_version"],
        "params": {"policy_version": v0},
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


def agent(
    gws: list[Proc],
    clients: list[openai.OpenAI],
    work: queue.Queue,
    stop: threading.Event,
    errors: list,
) -> None:
    """Take (trajectory, group) items until stopped: two turns, alternating gateways, then
    the reward. A 429 (the budget is full) is retried by the client, then here."""
    reward = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {REWARD_TOKEN}"})
    with reward:
        while not stop.is_set():
            try:
                traj, group = work.get_nowait()
            except queue.Empty:
                return
            ids = {"X-Claw-Trajectory": traj, "X-Claw-Group": group}
            try:
                for turn in range(TURNS):
                    c = clients[(hash(traj) + turn) % 2]
                    while True:
                        try:
                            c.chat.completions.create(model="sim", messages=ASK, extra_headers=ids)
                            break
                        except openai.RateLimitError:
                            if stop.is_set():
                                return
                gw = gws[turn % 2]
                r = reward.post(f"{gw.url}/t/{traj}/reward", json={"final_reward": 1.0})
                assert r.status_code == 200, r.text
            except Exception as e:  # reported by the test
                errors.append(e)
                return


def check_log(log: list[dict], staleness: int, v0: int, gws_seen: set) -> int:
    """Replay the admission log: every admission leaves admitted <= (s + v + 1) * B, the
    counter it reports is the replayed one (one counter for both gateways), versions only
    move forward. Returns the trajectories admitted."""
    count, started, last_v = v0 * BATCH, 0, v0
    for e in log:
        assert e["v"] >= last_v
        last_v = e["v"]
        assert e["budget"] == (staleness + e["v"] + 1) * BATCH
        if e["op"] == "admit":
            count += e["slots"]
            started += len(e["t"])
            assert count <= e["budget"], e
            assert e["slots"] % GROUP_SIZE == 0  # a new group reserves all of its slots
            gws_seen.add(e["w"])
        else:
            count -= e["slots"]
        assert count == e["admitted"], e
    return started


@pytest.mark.parametrize("staleness", [0, 1, 4])
def test_admission_bounds_staleness_across_two_gateways(setup, staleness):
    v0 = 1000 * (staleness + 1)  # each run's versions: older runs' turns never match
    up = setup["upstream"].url
    httpx.post(up + "/_version", json={"version": v0})
    store = Store(setup["url"], setup["namespace"])
    name = f"adm-s{staleness}"
    groups = 2 * GROUPS * (UPDATES + staleness + 2)
    work: queue.Queue = queue.Queue()
    for g in range(groups):
        for j in range(GROUP_SIZE):
            work.put((f"s{staleness}-g{g}-{j}", f"s{staleness}-g{g}"))
    stop, errors = threading.Event(), []
    client = BatchClient(setup["namespace"], setup["url"])
    agents = []
    served: list[np.ndarray] = []
    store.r.delete(admission.log_key(store))  # this run's log only
    try:
        client.register(recipe(name, staleness, v0))
        gws = setup["gateways"]
        clients = [  # one client per gateway, shared by the threads (httpx is thread-safe)
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key=TOKEN, max_retries=1) for gw in gws
        ]
        agents = [
            threading.Thread(target=agent, args=(gws, clients, work, stop, errors))
            for _ in range(THREADS)
        ]
        for a in agents:
            a.start()
        v = v0
        for _ in range(UPDATES):
            batch = client.pop(name, timeout=180, policy_version=v)
            versions = np.asarray(batch["policy_version"])
            assert versions.min() >= v - staleness, (v, versions)  # nothing older is served
            assert len(np.unique(batch["group_index"])) == GROUPS
            for gi in range(GROUPS):
                rows = batch["group_index"] == gi
                assert len(np.unique(batch["trajectory_index"][rows])) == GROUP_SIZE
            served.append(v - versions)
            v += 1
            httpx.post(up + "/_version", json={"version": v})  # the new weights, then
            client.set_params(name, policy_version=v)  # the new budget
        stop.set()
        for a in agents:
            a.join(60)
        assert not errors, errors[:3]
        assert not any(a.is_alive() for a in agents)
        st = client.stats(name)[name]["admission"]
        log = admission.read_log(store)
        seen: set = set()
        started = check_log(log, staleness, v0, seen)
        assert len(seen) == 2  # both gateways admitted, against one budget
        assert st["total"] == started and st["budget"] == (staleness + v + 1) * BATCH
        assert started > UPDATES * BATCH  # generation ran ahead of training ...
        assert started <= (staleness + UPDATES + 1) * BATCH + st["released"]  # ... boundedly
        if staleness == 0:
            assert st["waited"] > 0  # the agents outnumber the budget
        ss = st["served_staleness"]
        worst = max(int(s.max()) for s in served)
        assert ss["batches"] >= UPDATES and ss["max"] <= staleness and worst <= staleness
        shown = CliRunner().invoke(
            app, ["--redis-url", setup["url"], "recipes", setup["namespace"]]
        )
        assert shown.exit_code == 0, shown.output
        text = " ".join(shown.output.split())  # however the console wrapped it
        assert f"max_staleness {staleness}" in text and f"max {ss['max']} versions" in text
    finally:
        stop.set()
        for a in agents:
            a.join(60)
        client.unregister(name)
        client.close()

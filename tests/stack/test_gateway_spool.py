"""The gateway's spool against a SIGKILL: `claw gateway` (a subprocess) answers the `openai`
client's calls while no ingest worker runs (nothing can commit), is SIGKILLed, and a
gateway restarted on the same spool records what it left: every reward is taken with all
its turns, each stored once, numbered 0..n-1 in the order they were answered, a call
numbered before the kill keeping its index. Also: the turn script numbers a call id once,
a batch id is committed once, a call stored in parts is settled, a full spool is counted
and the call still recorded, and two gateways cannot share a spool."""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.schema import Schema
from claw_tasks.store import Store
from claw_tasks.store.turns import turn_infos
from orchestrator.delivery import admission
from orchestrator.gateway.recorder import TURN
from tests.support.gateway import (
    REWARD_TOKEN,
    TOKEN,
    TOKENS,
    Proc,
    gateway_argv,
    start_upstream,
    train_tokenizer,
)
from tests.support.processes import free_port

TRAJECTORIES, TURNS = 4, 3


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("spool-upstream")
    train_tokenizer(tmp / "tokenizer.json")
    proc = start_upstream(tmp / "tokenizer.json", tmp / "upstream.log")
    yield proc
    proc.stop()


@pytest.fixture
def gateways(upstream, redis_url, tmp_path) -> Iterator:
    """Start ``claw gateway`` on a port and spool (env over :data:`TOKENS`)."""
    procs: list[Proc] = []

    def start(namespace: str, port: int, spool: Path, **env: str) -> Proc:
        argv = gateway_argv(upstream.url, namespace, port, "--spool", str(spool))
        log = tmp_path / f"gateway-{len(procs)}.log"
        p = Proc([*argv[:3], "--redis-url", redis_url, *argv[3:]], port, log, {**TOKENS, **env})
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def answer(gw: Proc, traj: str, turn: int) -> str:
    """One chat call of ``traj`` through the gateway; its call id."""
    c = openai.OpenAI(base_url=f"{gw.url}/t/{traj}/g/q/v1", api_key=TOKEN, max_retries=0)
    raw = c.chat.completions.with_raw_response.create(
        model="sim", messages=[{"role": "user", "content": f"What is {turn} plus 2?"}]
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-claw-call-id"]


def reward(gw: Proc, traj: str) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/t/{traj}/reward",
        json={"final_reward": 1.0},
        headers={"Authorization": f"Bearer {REWARD_TOKEN}"},
        timeout=120,
    )


def metric(gw: Proc, name: str) -> float:
    page = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    found = re.search(rf"^{name} (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("numbered", [False, True], ids=["at-once", "numbered-unsent"])
def test_no_answered_turn_is_lost_to_a_gateway_sigkill(
    numbered, gateways, redis_url, start_worker, tmp_path
):
    """SIGKILLed at once after its last answer (calls still queued or gathered), or once
    every call is numbered while its batch cannot be published (the broker unreachable:
    the Ingestor holds it to re-send): the restarted gateway records every call, each
    stored once, at the index it was numbered with."""
    namespace, port, spool = f"sp-{uuid.uuid4().hex[:8]}", free_port(), tmp_path / "spool"
    store = Store(redis_url, namespace)
    env = {"CLAW_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"} if numbered else {}
    gw = gateways(namespace, port, spool, **env)
    calls = {f"t{k}": [answer(gw, f"t{k}", i) for i in range(TURNS)] for k in range(TRAJECTORIES)}
    numbered_as: dict[str, dict[str, int]] = {}
    if numbered:
        deadline = time.monotonic() + 60
        for traj, ids in calls.items():
            key = admission.trajectory_key(store, traj)
            while None in (got := store.r.hmget(key, [f"c:{c}" for c in ids])):
                assert time.monotonic() < deadline, "the calls were never numbered"
                time.sleep(0.02)
            numbered_as[traj] = {c: int(i) for c, i in zip(ids, got, strict=True)}
    gw.proc.kill()  # SIGKILL
    gw.proc.wait()
    assert list(spool.glob("*.spool"))
    gw = gateways(namespace, port, spool)
    assert metric(gw, "claw_gateway_spool_replayed_calls_total") == TRAJECTORIES * TURNS
    start_worker("ingest")
    for traj, ids in calls.items():
        r = reward(gw, traj)
        assert r.status_code == 200, r.text
        assert r.json()["turns"] == TURNS
        got = store.episode(traj, fields=[])
        assert got["step_index"].tolist() == list(range(TURNS))  # each once, no gap
        assert got["reward"].tolist() == [0.0] * (TURNS - 1) + [1.0]
        infos = turn_infos(store, got["id"])
        assert [i["call_id"] for i in infos] == ids  # in the order they were answered
        if numbered:
            assert {c: i for i, c in enumerate(ids)} == numbered_as[traj]
    deadline = time.monotonic() + 60
    while metric(gw, "claw_gateway_spool_bytes") and len(list(spool.glob("*.spool"))) > 1:
        assert time.monotonic() < deadline, "the spool kept settled calls"
        time.sleep(0.1)


def test_the_turn_script_numbers_a_call_once(redis_url):
    """A call id numbered again (re-recorded after a restart) gets its index back, even
    once the trajectory is finished; a new call of a finished trajectory is refused."""
    store = Store(redis_url, f"sp-{uuid.uuid4().hex[:8]}")
    keys = [admission.trajectory_key(store, "t"), admission.admission_key(store)]

    def turn(call_id: str) -> list:
        return TURN(store.r, keys, ["turn", 60, "", call_id])

    assert [turn("a"), turn("b"), turn("a"), turn("b")] == [[0, -1], [1, -1], [0, -1], [1, -1]]
    assert store.r.hget(keys[0], "turns") == b"2"
    TURN(store.r, keys, ["finish", 60, "digest"])
    assert turn("b") == [1, -1]
    assert turn("c") == [-1, -1]


def test_a_batch_sent_twice_is_stored_once(redis_url, start_worker):
    """What makes a replay of a published batch harmless: the ingest worker commits a batch
    id once (its done record), whichever of its messages comes second."""
    namespace = f"sp-{uuid.uuid4().hex[:8]}"
    with Ingestor(namespace, redis_url, flush_interval=None) as ing:
        steps = [ing.llm_step("e", i, [1, 2], [3], [-0.5]) for i in range(3)]
        ing.send_steps(steps, "gw-twice")
        ing.send_steps(steps, "gw-twice")
        start_worker("ingest")
        ing.flush(timeout=60)
    got = Store(redis_url, namespace).episode("e", fields=["response_ids"])
    assert got["step_index"].tolist() == [0, 1, 2]
    np.testing.assert_array_equal(np.concatenate(got["response_ids"]), [3, 3, 3])


def test_a_full_spool_is_counted_and_the_call_still_recorded(
    gateways, redis_url, start_worker, tmp_path
):
    """Past CLAW_GATEWAY_SPOOL_BYTES a call is answered and recorded from memory, counted
    (claw_gateway_spool_dropped_calls); a second gateway on the same spool is refused with
    one line."""
    namespace, spool = f"sp-{uuid.uuid4().hex[:8]}", tmp_path / "spool"
    gw = gateways(namespace, free_port(), spool, CLAW_GATEWAY_SPOOL_BYTES="1")
    start_worker("ingest")
    ids = [answer(gw, "full", i) for i in range(2)]
    r = reward(gw, "full")
    assert r.status_code == 200 and r.json()["turns"] == 2, r.text
    assert metric(gw, "claw_gateway_spool_dropped_calls_total") == 2
    infos = turn_infos(
        Store(redis_url, namespace), Store(redis_url, namespace).episode("full", fields=[])["id"]
    )
    assert [i["call_id"] for i in infos] == ids
    argv = gateway_argv(gw.url, namespace, free_port(), "--spool", str(spool))
    second = subprocess.run(
        [*argv[:3], "--redis-url", redis_url, *argv[3:]],
        env={**TOKENS, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path.cwd())},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode != 0
    assert "is held by another gateway process" in second.stderr + second.stdout


def test_a_call_past_a_shards_capacity_is_settled_once_all_its_parts_are(
    gateways, redis_url, start_worker, tmp_path
):
    """A call of more choices than a shard holds goes in parts (the Ingestor splits its
    batch); once the store has every part the spool settles it, so a gateway stopped then
    leaves an empty spool behind."""
    namespace, spool = f"sp-{uuid.uuid4().hex[:8]}", tmp_path / "spool"
    store = Store(redis_url, namespace)
    store.create(capacity=4, n_shards=1, schema=Schema.llm())
    start_worker("ingest")
    with Ingestor(namespace, redis_url, flush_interval=None) as ing:
        steps = [ing.llm_step("e", i, [1, 2], [3], [-0.5]) for i in range(6)]
        assert ing.send_steps(steps, "wide") == ["wide.c0", "wide.c4"]
    gw = gateways(namespace, free_port(), spool)
    c = openai.OpenAI(base_url=f"{gw.url}/t/wide/g/q/v1", api_key=TOKEN, max_retries=0)
    ask = [{"role": "user", "content": "What is 1 plus 2?"}]
    assert len(c.chat.completions.create(model="sim", n=8, messages=ask).choices) == 8
    deadline = time.monotonic() + 60
    while metric(gw, "claw_gateway_recorded_turns_total") < 8:
        assert time.monotonic() < deadline, "the call's turns were never recorded"
        time.sleep(0.1)
    gw.stop()  # SIGTERM: the recorder flushes, settles what the store confirmed
    assert not list(spool.glob("*.spool")), "a call stored in parts was never settled"


def test_turns_answered_while_the_store_is_away_are_numbered_once_it_is_back(upstream, tmp_path):
    """The store unreachable (a failover, a partition) while calls are answered: the
    recorder asks it again until it answers, rather than counting the calls unrecorded."""
    with RedisServer() as server:
        namespace, port = f"sp-{uuid.uuid4().hex[:8]}", free_port()
        argv = gateway_argv(upstream.url, namespace, port, "--spool", str(tmp_path / "spool"))
        env = {**TOKENS, "CLAW_BROKER_URL": server.url}
        gw = Proc([*argv[:3], "--redis-url", server.url, *argv[3:]], port, tmp_path / "gw.log", env)
        try:
            answer(gw, "away", 0)
            server.stop()
            second = answer(gw, "away", 1)  # admission unchecked: the call goes through
            time.sleep(2)  # the recorder tries and waits
            server.start()
            key = admission.trajectory_key(Store(server.url, namespace), "away")
            deadline = time.monotonic() + 60
            while server.client().hget(key, f"c:{second}") is None:
                assert time.monotonic() < deadline, "the call was never numbered"
                time.sleep(0.1)
            assert metric(gw, "claw_gateway_recorded_turns_total") == 2
            auth = {"Authorization": f"Bearer {TOKEN}"}
            page = httpx.get(f"{gw.url}/metrics", headers=auth).text
            assert 'reason="error"' not in page  # none counted unrecorded
        finally:
            gw.stop()

"""Every component on a deployment whose broker is not the store's server: the Compose
layout (store on Redis db 0, broker on db 1 of the same server) and RabbitMQ. Each
component is configured the way an operator configures it — ``CLAW_REDIS_URL`` and
``CLAW_BROKER_URL`` in its environment, or the store URL alone in code — and the test
asserts its work arrives: steps committed, batches served. A component that sends to the
store's server instead sends to a broker no worker reads."""

from __future__ import annotations

import http.cookiejar
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gymnasium import spaces
from typer.testing import CliRunner

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.settings import get_settings, use_settings
from claw_tasks.store import Store
from orchestrator.adapters.sb3 import ClawReplayBuffer
from orchestrator.adapters.torchrl import ClawSampler, ClawStorage
from orchestrator.cli.demo import apex
from orchestrator.cli.devstack import DevStack
from orchestrator.cli.main import app
from orchestrator.delivery.client import BatchClient
from tests.support.gateway import (
    REWARD_TOKEN,
    TOKEN,
    start_gateway,
    start_upstream,
    train_tokenizer,
)
from tests.support.paths import ROOT
from tests.support.processes import Worker
from tests.support.webserver import WebServer

DEADLINE = 90.0


def wait_for(cond: Callable[[], object], what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        tail = log.read_text()[-2000:] if log is not None else ""
        assert time.monotonic() < deadline, f"{what}\n{tail}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A server of this module's own: db 0 the store, db 1 the Redis broker."""
    with RedisServer() as s:
        yield s


@pytest.fixture(scope="module", params=["redis-db1", "amqp"])
def deployment(request, server, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(store URL, broker URL) and a worker on the ingest and prefetch queues of that
    broker only."""
    store = server.url
    assert store.endswith("/0")
    if request.param == "amqp":
        broker = request.getfixturevalue("broker_vhost")
    else:
        broker = store[: -len("/0")] + "/1"
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    worker = Worker(store, "ingest,prefetch", 2, log, {}, broker)
    yield store, broker
    worker.stop()


@pytest.fixture
def env(deployment, monkeypatch) -> dict[str, str]:
    """The deployment's two variables, in this process and for the subprocesses."""
    store, broker = deployment
    monkeypatch.setenv("CLAW_REDIS_URL", store)
    monkeypatch.setenv("CLAW_BROKER_URL", broker)
    use_settings()
    return {"CLAW_REDIS_URL": store, "CLAW_BROKER_URL": broker}


def test_clients_built_from_the_store_url_alone_use_the_broker(env):
    """The broker rule (Settings.broker_for): the one configured, whatever store URL a
    client is given."""
    store = env["CLAW_REDIS_URL"]
    assert get_settings().broker_for(store) == env["CLAW_BROKER_URL"]
    ns = f"sb-{uuid.uuid4().hex[:8]}"
    ing = Ingestor(ns, store, flush_interval=None)
    ing.add_batch(_vectors(40))
    assert ing.close(timeout=60).committed == 40
    assert Store(store, ns).count() == 40


def _vectors(n: int, episode: str = "e0") -> dict:
    return {
        "obs": np.arange(n, dtype=np.float32)[:, None].repeat(4, 1),
        "action": np.zeros(n, np.int64),
        "reward": np.ones(n, np.float32),
        "episode_id": episode,
        "step_index": np.arange(n),
    }


RECIPE = {
    "name": "plain",
    "batch_size": 16,
    "fields": ["obs", "reward"],
    "sources": [{"name": "all"}],
    "prefetch": {"depth": 2},
}


def test_claw_stats_and_recipes_report_the_workers_work(env):
    """`claw stats` counts the steps the workers committed; `claw recipes` the batches
    they produced for a client made from the store URL alone."""
    store = env["CLAW_REDIS_URL"]
    ns = f"cli-{uuid.uuid4().hex[:8]}"
    ing = Ingestor(ns, store, flush_interval=None)
    ing.add_batch(_vectors(64))
    assert ing.close(timeout=60).committed == 64
    client = BatchClient(ns, store)
    try:
        client.register(RECIPE)
        assert client.pop("plain", timeout=60)["reward"].shape == (16,)
    finally:
        client.close()
    runner = CliRunner()
    stats = runner.invoke(app, ["stats", "--namespace", ns, "--json"], env=env)
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output)["namespaces"][0]["steps"] == 64
    recipes = runner.invoke(app, ["recipes", ns, "--json"], env=env)
    assert recipes.exit_code == 0, recipes.output
    assert json.loads(recipes.output)["plain"]["produced"] >= 1


def test_gateway_turns_are_confirmed(env, tmp_path):
    """`claw gateway --upstream URL --namespace NS` with the deployment's variables: its
    turns reach the workers, so a reward (which waits for them) is answered."""
    tokenizer = tmp_path / "tokenizer.json"
    train_tokenizer(tokenizer)
    upstream = start_upstream(tokenizer, tmp_path / "upstream.log")
    ns = f"gw-{uuid.uuid4().hex[:8]}"
    gateway = start_gateway(upstream.url, ns, tmp_path, env=env)  # the deployment's Redis
    try:
        base = f"{gateway.url}/t/traj-1/g/q/v1"
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hello"}]}
        auth = {"Authorization": f"Bearer {TOKEN}"}
        answer = httpx.post(base + "/chat/completions", json=chat, headers=auth, timeout=60)
        assert answer.status_code == 200, answer.text
        reward = httpx.post(
            gateway.url + "/t/traj-1/reward",
            json={"final_reward": 1.0},
            headers={"Authorization": f"Bearer {REWARD_TOKEN}"},
            timeout=120,
        )
        assert reward.status_code == 200, (reward.text, gateway.log.read_text()[-2000:])
        assert Store(env["CLAW_REDIS_URL"], ns).count() == 1
    finally:
        gateway.stop()
        upstream.stop()


class Browser:
    """A cookie-keeping HTTP client that does not follow redirects."""

    def __init__(self, base: str) -> None:
        self.base = base
        no_redirect = type("NoRedirect", (urllib.request.HTTPRedirectHandler,), {})
        no_redirect.redirect_request = lambda *a, **k: None
        jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(jar), no_redirect
        )

    def request(self, path: str, data: dict | None = None) -> tuple[int, str]:
        body = None if data is None else urllib.parse.urlencode(data).encode()
        try:
            with self.opener.open(self.base + path, data=body, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


def test_web_app_recipe_change_is_refilled(env, tmp_path):
    """`claw web`: a recipe's params changed in the inspector drop its queued batches and
    ask the workers for new ones, which arrive."""
    store = env["CLAW_REDIS_URL"]
    ns = f"web-{uuid.uuid4().hex[:8]}"
    ing = Ingestor(ns, store, flush_interval=None)
    ing.add_batch(_vectors(64))
    assert ing.close(timeout=60).committed == 64
    client = BatchClient(ns, store)
    try:
        client.register(RECIPE)
        queue = client.registry.queue("plain")
        r = client.store.r
        wait_for(lambda: r.llen(queue) == 2, "the registered recipe's queue never filled")
        version = client.registry.get("plain").recipe.version
        web = WebServer(store, tmp_path / "web.log", broker_url=env["CLAW_BROKER_URL"])
        try:
            b = Browser(web.url)
            assert b.request("/login", {"user": "claw", "password": "pw"})[0] == 303
            _, html = b.request(f"/ns/{ns}/recipes")
            csrf = re.search(r'name="csrf" value="([^"]+)"', html).group(1)
            status, _ = b.request(f"/ns/{ns}/recipes/plain", {"csrf": csrf, "p.level": "2"})
            assert status == 303
            assert client.registry.get("plain").recipe.version == version + 1
            wait_for(lambda: r.llen(queue) > 0, "no batch after the inspector's change", web.log)
        finally:
            web.stop()
    finally:
        client.close()


def test_sb3_buffer_samples_what_it_added(env):
    obs, act = spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2)
    buf = ClawReplayBuffer(100, obs, act, device="cpu", timeout=60, deterministic=True)
    o = np.zeros((1, 3), np.float32)
    for t in range(20):
        nxt = np.full((1, 3), (t + 1) / 40, np.float32)
        buf.add(o, nxt, np.array([t % 2]), np.array([1.0]), np.array([False]), [{}])
        o = nxt
    got = buf.sample(8)
    assert got.observations.shape == (8, 3)
    assert Store(env["CLAW_REDIS_URL"], buf.namespace).count() == 20


def test_torchrl_storage_serves_batches(env):
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer

    n = 50
    data = TensorDict(
        {
            "observation": torch.randn(n, 3),
            "action": torch.zeros(n, dtype=torch.int64),
            ("next", "observation"): torch.randn(n, 3),
            ("next", "reward"): torch.ones(n, 1),
            ("next", "done"): torch.zeros(n, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(n, 1, dtype=torch.bool),
            ("next", "truncated"): torch.zeros(n, 1, dtype=torch.bool),
        },
        batch_size=[n],
    )
    storage = ClawStorage(1000, timeout=60)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ClawSampler(), batch_size=16)
    try:
        rb.extend(data)
        assert rb.sample().batch_size == torch.Size([16])
        assert Store(env["CLAW_REDIS_URL"], storage.namespace).count() == n
    finally:
        storage.close()


def test_demo_actor_records_through_the_stacks_broker(env, tmp_path):
    """`claw demo --redis-url` / `claw up` pick the broker by the same rule (DevStack),
    and the demo's actors record through it."""
    stack = DevStack(tmp_path)
    stack.start_redis(env["CLAW_REDIS_URL"])
    assert stack.broker_url == env["CLAW_BROKER_URL"]
    ns = f"demo-{uuid.uuid4().hex[:8]}"
    actor = apex.actor_service(stack, ns, 0, 1, seed=0, rate=200.0)
    log = tmp_path / "actor.log"
    proc = subprocess.Popen(
        actor.argv,
        cwd=ROOT,
        env={**actor.env, **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        store = Store(env["CLAW_REDIS_URL"], ns)
        wait_for(lambda: store.exists() and store.count() >= 128, "the actor's steps", log)
    finally:
        proc.terminate()
        proc.wait(60)

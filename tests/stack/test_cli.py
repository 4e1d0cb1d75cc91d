"""The `claw` CLI against a real Redis: stats, inspect, dead, doctor, metrics, up (the demo:
test_demo.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.message import IngestArgs
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.store.layout import META_CHUNK_SLOTS
from claw_tasks.worker.ingest import process
from orchestrator.cli.exporter import registry_for, serve
from orchestrator.cli.main import app

CLAW = str(Path(sys.executable).with_name("claw"))
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}  #(\d+)", re.M)
EPISODES = {"e0": ("reach", "a1", 5), "e1": ("reach", "a2", 7), "e2": ("grasp", "a1", 4)}


def batch(episode: str, n: int, task: str, agent: str, seed: int) -> StepBatch:
    rng = np.random.default_rng(seed)
    end = np.zeros(n, bool)
    end[-1] = True
    return StepBatch(
        episode=StrColumn.constant(episode, n),
        step_index=np.arange(n),
        reward=rng.standard_normal(n).astype(np.float32),
        terminated=end,
        truncated=np.zeros(n, bool),
        fields={
            "obs": rng.standard_normal((n, 4)).astype(np.float32),
            "action": rng.integers(0, 3, n),
        },
        strs={"task_id": StrColumn.constant(task, n), "agent_id": StrColumn.constant(agent, n)},
        nums={"t:level": np.full(n, float(seed))},
        next_rows=np.array([n - 1], np.int32),
        next_obs=np.ones((1, 4), np.float32),
    )


def fill(url: str, namespace: str) -> Store:
    """Three episodes over two shards, and one dead-lettered step (NaN reward)."""
    store = Store(url, namespace)
    store.create(capacity=1000, n_shards=2)
    for seed, (ep, (task, agent, n)) in enumerate(EPISODES.items()):
        store.commit(batch(ep, n, task, agent, seed))
    bad = batch("e3", 3, "reach", "a1", 9)
    bad.reward[1] = np.nan
    process(store, IngestArgs(namespace, bad.batch_id, bad.encode(), None), get_settings().limits)
    return store


@pytest.fixture(scope="module")
def filled(redis_server) -> tuple[str, Store]:
    ns = f"cli-{uuid.uuid4().hex[:8]}"
    return ns, fill(redis_server.url, ns)


@pytest.fixture
def claw(redis_url):
    runner = CliRunner()

    def invoke(*args: str, code: int = 0):
        result = runner.invoke(app, list(args), env={"CLAW_REDIS_URL": redis_url, "COLUMNS": "250"})
        assert result.exit_code == code, result.output
        return result

    return invoke


def test_stats_json_and_tables(claw, filled):
    ns, _ = filled
    doc = json.loads(claw("stats", "--namespace", ns, "--json").stdout)
    (s,) = doc["namespaces"]
    parts = [batch(e, n, t, a, i).reward for i, (e, (t, a, n)) in enumerate(EPISODES.items())]
    rewards = np.concatenate([*parts, batch("e3", 3, "reach", "a1", 9).reward[[0, 2]]])
    assert s["steps"] == 18 and s["capacity"] == 1000 and s["n_shards"] == 2
    assert s["dead_letters"] == 1 and s["episodes"] == 4
    assert {d["task_id"]: d["steps"] for d in s["by_task_id"]} == {"reach": 14, "grasp": 4}
    assert {d["agent_id"]: d["steps"] for d in s["by_agent_id"]} == {"a1": 11, "a2": 7}
    assert s["reward"]["mean"] == pytest.approx(rewards.mean(), rel=1e-5)
    assert s["reward"]["std"] == pytest.approx(rewards.std(), rel=1e-5)
    assert s["memory_bytes"] > 0 and s["schema"]["tags"] == {"level": "num"}
    out = claw("stats", "--namespace", ns).stdout
    assert ns in out and "grasp" in out and "float32[4]" in out and "tags.level" in out
    assert ns in claw("stats").stdout
    claw("stats", "--namespace", "no-such-ns", code=1)


def test_inspect_newest_episode_and_ids(claw, filled):
    ns, store = filled
    out = claw("inspect", ns, "--limit", "3").stdout
    ids = [int(i) for i in LINE.findall(out)]
    assert len(ids) == 3 and "obs=float32[4](" in out and "action=int64[](" in out
    out = claw("inspect", ns, "--episode", "e1").stdout
    lines = LINE.findall(out)
    assert len(lines) == 7 and "e1:6" in out and out.count("TERMINATED") == 1
    assert "next_obs=float32[4](1, 1, 1, 1)" in out and "agent_id=a2" in out
    some = store.episode("e0", fields=[])["id"][:2].tolist()
    out = claw("inspect", ns, "--ids", ",".join(map(str, some))).stdout
    assert [int(i) for i in LINE.findall(out)] == some and "tags.level=0" in out
    assert "not in the store" in claw("inspect", ns, "--ids", "999999", code=1).output
    assert "comma-separated" in claw("inspect", ns, "--ids", "x", code=1).output
    assert "has no stored steps" in claw("inspect", ns, "--episode", "nope", code=1).output


def test_dead_letters(claw, filled):
    ns, _ = filled
    out = claw("dead", ns).stdout
    assert "dead letters of" in out and "step 1 (episode 'e3', step_index 1)" in out
    assert "reward is nan" in out and "whole batch" not in out
    assert "does not exist" in claw("dead", ns + "-x", code=1).output


def test_doctor_clean_then_corrupt_link(claw, redis_url, r):
    ns = f"doc-{uuid.uuid4().hex[:8]}"
    store = fill(redis_url, ns)
    out = claw("doctor", ns).stdout
    assert "no problems found" in out
    ids = store.episode("e1", fields=[])["id"]
    shard, slot = (int(v[0]) for v in store.locate(ids[2:3]))
    chunk, off = divmod(slot, META_CHUNK_SLOTS)
    key = store.layout_keys.meta(shard, "next", chunk)
    r.setrange(key, off * 4, np.int32(-2).tobytes())  # points back two steps
    r.append(store.layout_keys.meta(shard, "reward", chunk), b"xx")
    r.set(store.layout_keys.stage("orphan"), b"payload")  # no TTL
    try:
        out = claw("doctor", ns, code=1).stdout
        assert "step_index 0, expected 3" in out
        assert "the layout says" in out and "has no TTL" in out
        assert "3 problem(s)" in out
        assert "claw doctor" in claw("stats", "--namespace", ns, code=1).output
        assert ns in json.loads(claw("stats", "--json").stdout)["unreadable"]
        text = generate_latest(registry_for(redis_url, redis_url)).decode()
        assert f'claw_namespace_readable{{namespace="{ns}"}} 0.0' in text
    finally:
        r.delete(*r.scan_iter(f"claw:{{{ns}*"))


def test_doctor_unknown_namespace(claw):
    assert "has no keys" in claw("doctor", "nothing-here", code=1).output


def test_metrics_collector_and_endpoint(filled, redis_url, r):
    ns, _ = filled
    r.rpush("ingest", b"m1", b"m2")
    try:
        text = generate_latest(registry_for(redis_url, redis_url)).decode()
        port = _free_port()
        server = serve(port, redis_url, redis_url, "127.0.0.1")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                served = resp.read().decode()
        finally:
            server.shutdown()
    finally:
        r.delete("ingest")
    for metrics in (text, served):
        assert f'claw_steps{{namespace="{ns}"}} 18.0' in metrics
        assert f'claw_capacity_steps{{namespace="{ns}"}} 1000.0' in metrics
        assert f'claw_dead_letters{{namespace="{ns}"}} 1.0' in metrics
        assert f'claw_steps_by_task{{namespace="{ns}",task_id="grasp"}} 4.0' in metrics
        assert 'claw_queue_depth{queue="ingest"} 2.0' in metrics
        assert 'claw_queue_depth{queue="maintenance"} 0.0' in metrics
        assert "claw_redis_used_memory_bytes " in metrics
        assert 'claw_up{component="store"} 1.0' in metrics


def test_metrics_report_down_components():
    text = generate_latest(registry_for("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0"))
    assert b'claw_up{component="store"} 0.0' in text
    assert b'claw_up{component="broker"} 0.0' in text


def test_demo_fails_clearly_without_redis(tmp_path):
    result = CliRunner().invoke(
        app, ["demo", "--log-dir", str(tmp_path)], env={"CLAW_REDIS_URL": "redis://127.0.0.1:1/0"}
    )
    assert result.exit_code == 1
    assert "does not answer PING" in result.output


def test_up_runs_the_stack_and_stops_it(own_redis_url, tmp_path):
    redis_url = own_redis_url
    metrics_port, flower_port, web_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "CLAW_REDIS_URL": redis_url, "COLUMNS": "250"}
    for name in ("FLOWER_BASIC_AUTH", "CLAW_WEB_PASSWORD", "CLAW_WEB_PASSWORD_FILE"):
        env.pop(name, None)
    args = [
        CLAW,
        "up",
        "--metrics-port",
        str(metrics_port),
        "--flower-port",
        str(flower_port),
        "--web-port",
        str(web_port),
        "--log-dir",
        str(tmp_path),
    ]
    (tmp_path / "beat.log").write_text("an earlier run\n")
    (tmp_path / "beat.log.1").write_text("the run before\n")
    log = tmp_path / "up.out"
    with log.open("w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "Ctrl-C stops everything" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        table = log.read_text()
        for name in ("worker (all)", "beat", "flower", "metrics"):
            assert name in table
        assert f"Flower on port {flower_port} runs without auth" in table
        assert "FLOWER_BASIC_AUTH=user:password" in table
        assert (tmp_path / "beat.log.1").read_text() == "an earlier run\n"  # rotated, kept
        assert (tmp_path / "beat.log.2").read_text() == "the run before\n"
        pids = [
            int(p) for p in re.findall(r"│ (?:worker \(all\)|beat|flower|web)\s+│ (\d+)", table)
        ]
        assert len(pids) == 4
        # the inspector's password, made by `claw up`, printed once and nowhere else
        passwords = re.findall(rf"127.0.0.1:{web_port}/ user claw, password (\S+) \(", table)
        assert len(passwords) == 1, table
        assert passwords[0] not in (tmp_path / "web.log").read_text()
        login = urllib.parse.urlencode({"user": "claw", "password": passwords[0]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{web_port}/login", data=login)
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        with opener.open(req, timeout=30) as resp:  # follows to the namespaces page
            assert b'id="namespaces"' in resp.read()
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert b"claw_queue_depth" in resp.read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped." in log.read_text()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_password_never_printed() -> None:
    from claw_tasks.connection.server import RedisServer

    runner = CliRunner()
    with RedisServer() as server:
        server.client().config_set("requirepass", "s3cret-pw")
        url = server.url.replace("redis://", "redis://:s3cret-pw@")
        for args in (["stats"], ["doctor"], ["recipes", "nope"]):
            result = runner.invoke(app, args, env={"CLAW_REDIS_URL": url, "COLUMNS": "250"})
            assert "s3cret-pw" not in result.output, (args, result.output)
        down = url.rsplit(":", 1)[0] + ":1/0"
        result = runner.invoke(app, ["stats"], env={"CLAW_REDIS_URL": down})
        assert result.exit_code == 1 and "***" in result.output
        assert "s3cret-pw" not in result.output
        server.client(password="s3cret-pw").config_set("requirepass", "")


def test_tables_are_readable_at_80_columns(redis_url, filled):
    """Nothing cut with an ellipsis, no line wider than the terminal."""
    ns, store = filled
    recipe = {
        "name": "a-rather-long-recipe-name",
        "batch_size": 4,
        "fields": ["obs"],
        "sources": [{"name": "a"}],
        "rate_limit": {"samples_per_insert": 1, "min_size": 99},
    }
    from orchestrator.delivery.registry import Registry
    from orchestrator.recipe.model import Recipe

    Registry(store).put(Recipe.model_validate(recipe), None)
    runner = CliRunner()
    for args in (["stats"], ["stats", "-n", ns], ["recipes", ns], ["doctor", ns], ["dead", ns]):
        out = runner.invoke(app, args, env={"CLAW_REDIS_URL": redis_url, "COLUMNS": "80"}).output
        assert "…" not in out, (args, out)
        assert max(len(line) for line in out.splitlines()) <= 80, (args, out)
        assert args[0] == "doctor" or ns in out.replace("\n", "")  # doctor folds it in a cell
    out = runner.invoke(app, ["recipes", ns], env={"CLAW_REDIS_URL": redis_url, "COLUMNS": "80"})
    assert "a-rather-long-recipe-name: waiting for min_size:" in out.output.replace("\n", " ")


def test_recipes_of_an_unknown_namespace_exits_1(claw):
    out = claw("recipes", "no-such-namespace", code=1).output
    assert "namespace 'no-such-namespace' does not exist" in out

"""The running stack: RedBeat beat drives the refill safety net; Flower sees the tasks."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from orchestrator.delivery import shm
from orchestrator.delivery.registry import Registry
from orchestrator.recipe.model import Recipe
from tests.support.processes import Worker, celery, free_port, stop


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """This file's own redis-server: beat's passes and the worker's warm shutdown go over
    every namespace on the server, and the session's holds every earlier test's."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def stack_worker(redis_url, tmp_path):
    w = Worker(redis_url, "ingest,prefetch,maintenance", 2, tmp_path / "worker.log", {})
    yield w
    w.stop()


def _ingest(redis_url: str, namespace: str, n: int = 300) -> None:
    ing = Ingestor(namespace, redis_url, flush_interval=None)
    ing.add_batch(
        {
            "obs": np.zeros((n, 4), np.float32),
            "action": np.zeros(n, np.int64),
            "reward": np.ones(n, np.float32),
            "episode_id": "e",
            "step_index": np.arange(n),
        }
    )
    assert ing.close().committed == n


def test_beat_refills_queues_without_any_trainer(redis_url, namespace, stack_worker, tmp_path, r):
    _ingest(redis_url, namespace)
    reg = Registry(Ingestor(namespace, redis_url, flush_interval=None).store)
    recipe = Recipe.model_validate(
        {
            "name": "beat",
            "batch_size": 16,
            "fields": ["obs"],
            "sources": [{"name": "all"}],
            "prefetch": {"depth": 4},
        }
    )
    reg.put(recipe, shm.host_id())  # registered, but nobody asks for a refill
    beat = celery(
        ["beat", "-S", "redbeat.RedBeatScheduler", "-l", "INFO"],
        redis_url,
        tmp_path / "beat.log",
        CLAW_SCHEDULE="{claw-refill: {every: 1s}}",
    )
    try:
        deadline = time.monotonic() + 60
        while r.llen(reg.queue("beat")) < 4:
            assert beat.poll() is None, (tmp_path / "beat.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "beat.log").read_text()
            time.sleep(0.2)
    finally:
        stop(beat)
    assert r.llen(reg.queue("beat")) == 4
    assert r.exists("claw:redbeat:claw-refill")  # the schedule lives in Redis (RedBeat)


def test_a_beat_killed_holding_its_lock_is_replaced_within_a_minute(redis_url, tmp_path):
    """Beat SIGKILLed: its lock in Redis outlives it. The next beat takes the lock once it
    lapses (30 s; RedBeat's default, 25 minutes, stopped all maintenance that long)."""

    def start(log: str) -> subprocess.Popen:
        beat = ["beat", "-S", "redbeat.RedBeatScheduler", "-l", "INFO"]
        return celery(beat, redis_url, tmp_path / log)

    first = start("first.log")
    try:
        deadline = time.monotonic() + 60
        while b"Acquired lock" not in (tmp_path / "first.log").read_bytes():
            assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    second = start("second.log")
    try:
        deadline = time.monotonic() + 90
        while b"Acquired lock" not in (tmp_path / "second.log").read_bytes():
            assert time.monotonic() < deadline, (tmp_path / "second.log").read_text()[-2000:]
            time.sleep(0.2)
    finally:
        stop(second)


def test_flower_sees_ingest_tasks(redis_url, namespace, stack_worker, tmp_path):
    port = free_port()
    flower = celery(
        ["flower", f"--port={port}", "--address=127.0.0.1"],
        redis_url,
        tmp_path / "flower.log",
        FLOWER_BASIC_AUTH="claw:secret",
    )
    auth = "Basic " + base64.b64encode(b"claw:secret").decode()

    def get(path: str, with_auth: bool = True) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if with_auth:
            req.add_header("Authorization", auth)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, b""
        except OSError:
            return 0, b""

    try:
        deadline = time.monotonic() + 60
        while get("/healthcheck")[0] != 200:
            assert flower.poll() is None and time.monotonic() < deadline, (
                tmp_path / "flower.log"
            ).read_text()
            time.sleep(0.3)
        assert get("/api/tasks", with_auth=False)[0] == 401  # basic auth is on
        # Flower answers before its event receiver runs: tasks sent before then go unseen,
        # so send another batch now and then until one shows up as done.
        deadline, sent_at = time.monotonic() + 90, 0.0
        while True:
            if time.monotonic() - sent_at > 3:
                _ingest(redis_url, namespace, 50)
                sent_at = time.monotonic()
            status, body = get("/api/tasks?taskname=claw_tasks.ingest")
            tasks = json.loads(body) if status == 200 else {}
            if any(t.get("state") == "SUCCESS" for t in tasks.values()):
                break
            assert time.monotonic() < deadline, (status, body[:500])
            time.sleep(0.3)
    finally:
        stop(flower)

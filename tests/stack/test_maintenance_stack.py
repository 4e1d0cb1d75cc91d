"""Maintenance on the running stack: RedBeat beat drives eviction, recomputation, the
quality and lineage-index passes on short intervals, `claw schedule` shows the entries
(nightly archive included), and a failing maintenance task is FAILED in Flower's API."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from claw_tasks.broker.app import client_app
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from claw_tasks.store.retention import Retention
from claw_tasks.worker.context import forget
from orchestrator.delivery.lineage import LineageLog, record
from orchestrator.delivery.lineage_index import MIN_SEGMENT
from orchestrator.maintenance.quality import read_quality
from tests.support.paths import ROOT
from tests.support.processes import celery, free_port, stop
from tests.support.stepdata import batch, episode


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """This file's own redis-server: beat's passes and the worker's warm shutdown go over
    every namespace on the server, and the session's holds every earlier test's."""
    with RedisServer() as server:
        yield server


FAST = (
    "{claw-evict: {every: 1}, claw-priorities: {every: 1s}, claw-refill: {every: 1m}, "
    "claw-quality: {every: 1s}, claw-lineage: {every: 1s}}"
)


def _wait(cond, what: str, log, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_beat_runs_eviction_and_recomputation(redis_url, namespace, start_worker, tmp_path):
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(batch(episode(1, 30)), now=time.time() - 7200)
    store.commit(batch(episode(2, 20)))
    store.set_retention(Retention(max_age=3600))
    store.set_priority_rules({"unsampled_boost": 1.0})
    lineage = LineageLog(store)
    with store.r.pipeline(transaction=False) as pipe:  # popped batches: enough to index
        for k in range(MIN_SEGMENT):
            lineage.queue(pipe, record("r", 1, f"v{k // 100}", [1 + k % 50]))
        pipe.execute()
    start_worker("maintenance")
    log = tmp_path / "beat.log"
    beat = celery(
        ["beat", "-S", "redbeat.RedBeatScheduler", "-l", "INFO"], redis_url, log, CLAW_SCHEDULE=FAST
    )
    try:
        _wait(lambda: store.evictions()["ttl"] == 30, "beat did not run eviction", log)
        _wait(lambda: store.r.hexists(store.owned_key("prio"), "last"), "no recomputation", log)
        assert store.count() == 20
        _wait(lambda: (read_quality(store) or {}).get("steps") == 20, "no quality pass", log)
        assert read_quality(store)["fields"]["reward"]["count"] == 20
        assert (store.episode("ep2", fields=[])["priority"] == 1.0).all()  # boosted
        _wait(lambda: lineage.index.state()[1] is not None, "no lineage index pass", log)
        assert lineage.counts() == {f"v{k}": min(100, MIN_SEGMENT - 100 * k) for k in range(11)}
        env = {
            **os.environ,
            "CLAW_REDIS_URL": redis_url,
            "PYTHONPATH": str(ROOT),
            "CLAW_SCHEDULE": FAST,
        }
        out = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli.main", "schedule", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        shown = {e["name"]: e for e in json.loads(out.stdout)}
        archive = shown["claw-archive"]
        assert archive["task"] == "claw.maintenance.archive"
        assert archive["schedule"] == "cron 0 3 * * *" and "T03:00:00" in archive["next_run"]
        assert shown["claw-evict"]["scheduled"] and shown["claw-evict"]["runs"] >= 1
        assert shown["claw-evict"]["schedule"] == "every 1s"
    finally:
        stop(beat)
        store.set_retention(None)
        store.set_priority_rules(None)
        forget(namespace, dropped=False)


def test_a_failing_maintenance_task_is_failed_in_flower(
    redis_url, namespace, start_worker, tmp_path
):
    store = Store(redis_url, namespace)
    store.create(capacity=1000)
    store.commit(batch(episode(1, 10)))
    store.set_priority_rules(
        {"scorer": "tests.support.scorers:by_obs"}
    )  # not in this worker's CLAW_SCORERS
    start_worker("maintenance")
    port = free_port()
    log = tmp_path / "flower.log"
    flower = celery(
        ["flower", f"--port={port}", "--address=127.0.0.1"],
        redis_url,
        log,
        FLOWER_BASIC_AUTH="claw:secret",
    )
    auth = "Basic " + base64.b64encode(b"claw:secret").decode()

    def get(path: str) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        req.add_header("Authorization", auth)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return json.loads(resp.read())
        except OSError:
            return {}

    app = client_app(redis_url)
    try:
        failed: list[dict] = []
        sent_at = 0.0

        def seen() -> bool:
            nonlocal sent_at
            if time.monotonic() - sent_at > 3:  # Flower may start listening late
                app.send_task("claw.maintenance.priorities", queue="maintenance")
                sent_at = time.monotonic()
            tasks = get("/api/tasks?taskname=claw.maintenance.priorities&state=FAILURE")
            failed[:] = list(tasks.values())
            return bool(failed)

        _wait(seen, "no FAILED task in Flower", log)
        assert "not allowed on this worker" in failed[0]["exception"]
        assert namespace in failed[0]["exception"]
    finally:
        stop(flower)
        store.set_priority_rules(None)
        forget(namespace, dropped=False)

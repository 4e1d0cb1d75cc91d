"""The simulated hosts (tests/soak/hosts.py) are what Claw takes for separate machines: each
its own address and ``/dev/shm`` (so its own host id), reachable over the bridge until a
partition cuts it off; and Claw spread over them works: steps recorded on one host,
committed by a worker on another, served to a trainer on a third inline (no shared memory
across hosts) while a trainer on the worker's host gets the same recipe through /dev/shm."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from claw_tasks.worker.command import worker_argv
from tests.soak.hosts import Network, unavailable, wait_for
from tests.soak.soak import redis_argv
from tests.support.paths import ROOT

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

PORT = 7001

RECORD = """
import sys, numpy as np
from claw_tasks.client import Ingestor
url, ns = sys.argv[1:3]
with Ingestor(ns, url, flush_steps=50) as ing:
    for e in range(4):
        with ing.episode(episode_id=f"e{e}") as ep:
            for t in range(50):
                obs = np.full(1024, 100 * e + t, np.float32)  # 4 KiB: batches go by shm
                ep.add(obs, np.int64(t % 2), float(100 * e + t))
print("recorded")
"""

TRAIN = """
import json, sys, time
from orchestrator import BatchClient
from orchestrator.delivery.shm import reference_of
url, ns, name = sys.argv[1:4]
client = BatchClient(ns, url)
client.register({"name": name, "batch_size": 128, "fields": ["obs", "reward"],
                 "sources": [{"name": "all"}]})
reg = client.registry
deadline = time.monotonic() + 120
while not reg.r.llen(reg.queue(name)) and time.monotonic() < deadline:
    time.sleep(0.05)
head = reg.r.lindex(reg.queue(name), 0)
popped = 0
for _ in range(5):
    b = client.pop(name, timeout=60)
    assert (b["obs"][:, 0] == b["reward"]).all() and (b["obs"][:, -1] == b["reward"]).all()
    popped += len(b["reward"])
print(json.dumps({"popped": popped, "host": client.host, "shm": reference_of(head) is not None}))
client.close()
"""


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Network]:
    with Network(["store", "worker", "trainer"]) as network:
        yield network


def test_hosts_are_apart_and_a_partition_cuts_one_off(net: Network, tmp_path: Path) -> None:
    devs = {h: net[h].check_output(["stat", "-c", "%d", "/dev/shm"]).strip() for h in net.hosts}
    assert len(set(devs.values())) == 3, devs  # three /dev/shm, none the machine's own
    ids = {
        h: net[h]
        .check_output(_python("from orchestrator.delivery.shm import host_id; print(host_id())"))
        .strip()
        for h in net.hosts
    }
    assert len(set(ids.values())) == 3, ids
    store = net["store"]
    server = store.run(redis_argv(store.addr, PORT, tmp_path), log=tmp_path / "redis.log")
    try:
        ping = ["redis-cli", "-h", store.addr, "-p", str(PORT), "ping"]

        def answers() -> bool:
            try:
                return net["trainer"].check_output(ping, timeout=5).strip() == "PONG"
            except (RuntimeError, subprocess.TimeoutExpired):
                return False

        wait_for(answers, "the store answers across the bridge")
        store.partition()
        assert not answers()
        store.heal()
        wait_for(answers, "the store answers again once healed")
    finally:
        server.kill()
        server.wait()


def test_steps_cross_three_hosts_and_trainers_get_them_inline_or_by_shm(
    net: Network, tmp_path: Path
) -> None:
    store, worker_host, trainer = net["store"], net["worker"], net["trainer"]
    redis = store.run(redis_argv(store.addr, PORT, tmp_path), log=tmp_path / "redis.log")
    url = f"redis://{store.addr}:{PORT}/0"
    env = {"CLAW_REDIS_URL": url, "CLAW_BROKER_URL": url, "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "worker.log"
    worker = worker_host.run(
        worker_argv(
            "ingest,prefetch", 2, name=f"w{uuid.uuid4().hex[:6]}", lone=True, heartbeat=False
        ),
        log=log,
        env=env,
        cwd=ROOT,
    )
    try:
        wait_for(
            lambda: b"ready." in log.read_bytes() or worker.poll() is not None,
            "the worker starts",
            timeout=120,
        )
        assert worker.poll() is None, log.read_text()[-3000:]
        ns = f"t-{uuid.uuid4().hex[:8]}"
        out = trainer.check_output(_python(RECORD, url, ns), timeout=180)
        assert "recorded" in out
        far = json.loads(trainer.check_output(_python(TRAIN, url, ns, "far"), timeout=180))
        near = json.loads(worker_host.check_output(_python(TRAIN, url, ns, "near"), timeout=180))
        assert far["popped"] == near["popped"] == 640
        assert far["host"] != near["host"]
        assert (far["shm"], near["shm"]) == (False, True)  # inline over TCP / by /dev/shm
    finally:
        for proc in (worker, redis):
            proc.kill()
            proc.wait()

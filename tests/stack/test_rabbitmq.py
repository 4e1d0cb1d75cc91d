"""The Celery broker on RabbitMQ (``amqp://``): ingest and prefetch end to end, with
workers, the Ingestor, BatchClient fill requests and ``claw metrics`` on this machine's
RabbitMQ: what is RabbitMQ's own (quorum queues, delayed delivery, hostile headers, queue
depths, `claw up`). Each module run gets its own vhost (``rabbitmqctl``, conftest's
``amqp_url``), deleted afterwards, so the durable quorum queues carry nothing over between
runs. The tests of test_ingest and test_prefetch marked ``both_brokers`` run on both."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from kombu import Connection

from claw_tasks.broker.app import client_app
from claw_tasks.client import Ingestor
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.message import IngestArgs
from claw_tasks.store import Store
from orchestrator.cli.exporter import ClawCollector
from orchestrator.delivery.client import BatchClient
from tests.support.hostile import body, headers, ingest_body, messages_done, outcomes, wait_for
from tests.support.paths import ROOT
from tests.support.processes import Worker
from tests.support.producer import outcome


@pytest.fixture(scope="module")
def amqp_worker(redis_server, amqp_url, tmp_path_factory) -> Iterator[Worker]:
    log = tmp_path_factory.mktemp("worker") / "amqp.log"
    w = Worker(redis_server.url, "ingest,prefetch", 2, log, {"CLAW_BROKER_URL": amqp_url})
    yield w
    w.stop()


def _batch(n: int, episode: str) -> StepBatch:
    return StepBatch(
        episode=StrColumn.constant(episode, n),
        step_index=np.arange(n),
        reward=np.ones(n, np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields={"obs": np.ones((n, 8), np.float32), "action": np.zeros(n, np.int64)},
    )


def test_queues_are_durable_quorum_queues(amqp_url, amqp_worker):
    with Connection(amqp_url) as conn, conn.channel() as ch:
        for q in ("ingest", "prefetch"):
            # A passive declare with other arguments fails: these are quorum queues.
            assert ch.queue_declare(q, passive=True).queue == q
        with pytest.raises(conn.channel_errors, match="x-queue-type"), conn.channel() as other:
            other.queue_declare(
                "ingest", durable=True, auto_delete=False, arguments={"x-queue-type": "classic"}
            )


def test_ingest_commit_duplicate_and_hostile(redis_url, namespace, amqp_url, amqp_worker, r):
    ing = Ingestor(namespace, redis_url, broker_url=amqp_url, flush_interval=None)
    with ing.episode(episode_id="e") as ep:
        for t in range(50):
            ep.add(np.full(8, t, np.float32), np.int64(t), float(t), terminated=t == 49)
    assert ing.close().committed == 50
    store = Store(redis_url, namespace)
    np.testing.assert_array_equal(store.episode("e")["action"], np.arange(50))

    # The same message delivered twice (a producer retry): stored once.
    batch = _batch(20, "dup")
    args = IngestArgs(namespace, batch.batch_id, batch.encode(), None).to_args()
    app = client_app(amqp_url)
    app.send_task("claw_tasks.ingest", args=args, queue="ingest")
    assert outcome(store, batch.batch_id).committed == 20
    # Sent again once the first has committed: two deliveries running at once (concurrency
    # 2) may both reach the commit, and a batch's outcome is counted once, not per delivery.
    app.send_task("claw_tasks.ingest", args=args, queue="ingest")
    assert wait_for(r, 3, namespace) == 3
    assert outcomes(r, namespace)["duplicate"] == 1
    assert store.count() == 70

    # A countdown (how ingest retries) goes through RabbitMQ's delayed delivery: it comes
    # back with the delay in its routing key, and the guard still knows its queue.
    later = _batch(7, "later")
    args = IngestArgs(namespace, later.batch_id, later.encode(), None).to_args()
    app.send_task("claw_tasks.ingest", args=args, queue="ingest", countdown=1)
    assert outcome(store, later.batch_id).committed == 7

    # Hostile messages on the quorum queue: dead-lettered with a reason, the worker lives.
    before = messages_done(r, None)  # messages with an outcome (not letters or bytes)
    queue = app.amqp.queues["ingest"]
    with app.producer_or_acquire() as producer:
        publish = lambda data, hdrs: producer.publish(  # noqa: E731
            data,
            exchange=queue.exchange,
            routing_key="ingest",
            headers=hdrs,
            content_type="application/x-msgpack",
            content_encoding="binary",
            serializer=None,
            declare=[queue],
            retry=True,
        )
        publish(b"\xc1not msgpack", headers())
        publish(body("not a list"), headers(timelimit="soon"))
        # A message redelivered MAX_DELIVERIES times (forged count: RabbitMQ adds the header
        # on redeliveries, and a producer forging it only gets its own message refused).
        publish(ingest_body(namespace, "p" * 8, b"x"), headers(**{"x-delivery-count": 5}))
    assert wait_for(r, before + 3, None) == before + 3
    reasons = [f[b"reason"] for _, f in r.xrange("claw:rejects")]
    assert any(b"delivered 6 times" in x for x in reasons)
    assert amqp_worker.proc.poll() is None
    ing = Ingestor(namespace, redis_url, broker_url=amqp_url, flush_interval=None)
    ing.add_batch(
        {
            "obs": np.zeros((5, 8), np.float32),
            "action": np.zeros(5, np.int64),
            "reward": np.ones(5, np.float32),
            "episode_id": "after",
            "step_index": np.arange(5),
        }
    )
    assert ing.close().committed == 5
    assert store.count() == 82


def test_prefetch_register_pop_update_priorities(redis_url, namespace, amqp_url, amqp_worker):
    ing = Ingestor(namespace, redis_url, broker_url=amqp_url, flush_interval=None)
    ing.add_batch(
        {
            "obs": np.arange(200, dtype=np.float32)[:, None].repeat(8, 1),
            "action": np.zeros(200, np.int64),
            "reward": np.ones(200, np.float32),
            "episode_id": "v",
            "step_index": np.arange(200),
        }
    )
    assert ing.close().committed == 200
    client = BatchClient(namespace, redis_url, broker_url=amqp_url)
    sampler = {"kind": "priority", "alpha": 1.0, "beta": 0.5}
    client.register(
        {
            "name": "prio",
            "batch_size": 64,
            "fields": ["obs", "reward"],
            "sources": [{"name": "all", "sampler": sampler}],
            "prefetch": {"depth": 2},
        }
    )
    assert client.pop("prio", timeout=60)["obs"].shape == (64, 8)
    ids = Store(redis_url, namespace).episode("v", fields=[])["id"]
    pr = np.full(len(ids), 1e-6, np.float32)
    pr[:10] = 1.0
    assert client.update_priorities(ids, pr, wait=True) == 200
    version = client.set_params("prio").version
    rows = []
    while len(rows) < 5:  # each pop below low water sends a fill request over amqp
        b = client.pop("prio", timeout=60)
        if b.recipe_version == version:
            rows.append(b.ids)
    assert np.isin(np.concatenate(rows), ids[:10]).mean() > 0.95
    client.close()


def test_metrics_queue_depth_on_amqp(redis_url, amqp_url, amqp_worker):
    app = client_app(amqp_url)
    for _ in range(3):  # nobody here consumes the maintenance queue
        app.send_task("claw.maintenance.nothing", queue="maintenance")
    collector = ClawCollector(redis_url, amqp_url)
    deadline = time.monotonic() + 30
    while True:
        depths = {s.labels["queue"]: s.value for s in collector._queue_depths().samples}
        if depths["maintenance"] == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert depths == {"ingest": 0, "prefetch": 0, "maintenance": 3}


def test_claw_up_runs_on_rabbitmq(own_redis_url, amqp_url, tmp_path):
    redis_url = own_redis_url
    port = _free_port()
    env = {
        **os.environ,
        "CLAW_REDIS_URL": redis_url,
        "CLAW_BROKER_URL": amqp_url,
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "250",
    }
    args = [
        sys.executable,
        "-m",
        "orchestrator.cli.main",
        "up",
        "--metrics-port",
        str(port),
        "--flower-port",
        str(_free_port()),
        "--web-port",
        str(_free_port()),
        "--log-dir",
        str(tmp_path),
    ]
    log = tmp_path / "up.out"
    with log.open("w") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "Ctrl-C stops everything" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "amqp://guest:***@" in log.read_text()  # the broker row, password redacted
        worker_log = next(tmp_path.glob("worker-*.log")).read_text()
        assert f"transport:   amqp://guest:**@127.0.0.1:5672/{amqp_url.rsplit('/', 1)[1]}" in (
            worker_log
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        assert 'claw_up{component="broker"} 1.0' in text
        assert 'claw_queue_depth{queue="ingest"}' in text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

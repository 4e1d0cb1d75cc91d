"""Real services for the tests: a private redis-server (or a 3-master Redis Cluster), real
Celery worker processes, and a vhost of this machine's RabbitMQ as the other broker."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import settings

from claw_tasks.connection.client import Client, redis_client
from claw_tasks.connection.cluster import LocalCluster
from claw_tasks.connection.server import RedisServer
from claw_tasks.settings import use_settings
from claw_tasks.store import Store
from claw_tasks.store.config import NamespaceError
from claw_tasks.worker.context import forget
from tests.support.processes import Worker

# Property tests draw the same examples on every run (a failure in CI is reproducible and
# no run fails by luck); `HYPOTHESIS_PROFILE=explore pytest …` searches afresh.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# albumentations asks the network for a newer version when imported (in every worker too):
# the tests reach no network they do not start.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


@pytest.fixture(scope="session", autouse=True)
def sb3_logs_in_pytest_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Stable-Baselines3 makes a log folder per ``learn()`` (``/tmp/SB3-<time>`` unless
    ``SB3_LOGDIR`` names one): the tests' go under pytest's own temporary directory, which
    it prunes, and to the workers the tests start (they inherit the environment)."""
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3-logs"))


@pytest.fixture(autouse=True)
def fresh_settings() -> Iterator[None]:
    """Each test reads the settings from its own environment (``get_settings()`` keeps
    them per process): once before, and again after its monkeypatches are undone."""
    use_settings()
    yield
    use_settings()


@pytest.fixture
def own_redis_url() -> Iterator[str]:
    """A private, empty redis-server for one test (the session one holds every earlier
    test's namespaces, which a whole-stack test would scan on every scrape and page)."""
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A 3-master Redis Cluster on loopback free ports, for the tests marked ``both_stores``."""
    with LocalCluster(3) as cluster:
        yield cluster


SLOW_TIMEOUT = 3600
"""Seconds a ``slow`` test may run without a timeout of its own: the suite's 300 s
(pyproject.toml) is for the CI variants; the learning runs and storms take 1-42 minutes a
file on 2 cores at load 18-31 (docs/architecture.md, "How long the slow tests take")."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A ``slow`` test without a ``timeout`` marker (its own, its class's or its module's)
    gets ``SLOW_TIMEOUT``; every other test keeps the suite's timeout."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``both_stores`` runs on a standalone Redis and on a Redis Cluster
    (the data store); one marked ``both_brokers`` with the Celery broker on Redis and on
    RabbitMQ (``both_brokers(brokers=["redis"])``: Redis only, in a module whose other
    tests run on both, so it shares their worker). RabbitMQ runs with the standalone store
    only: a cluster with RabbitMQ would start a worker per module more for what the two
    runs already cover apart."""
    stores = ["redis", "cluster"] if metafunc.definition.get_closest_marker("both_stores") else []
    marker = metafunc.definition.get_closest_marker("both_brokers")
    if marker and "broker" in metafunc.fixturenames:
        brokers = marker.kwargs.get("brokers", ["redis", "amqp"])
        combos = [
            (s, b) for s in stores or ["redis"] for b in brokers if s == "redis" or b == "redis"
        ]
        metafunc.parametrize(
            ("backend", "broker"),
            combos,
            indirect=True,
            scope="module",
            ids=[s if b == "redis" else f"{s}-{b}" for s, b in combos],
        )
    elif stores:
        metafunc.parametrize("backend", stores, indirect=True, scope="module")


@pytest.fixture(scope="module")
def backend(request: pytest.FixtureRequest) -> str:
    """``redis`` (standalone) or ``cluster``: which data store ``redis_url`` names."""
    return getattr(request, "param", "redis")


@pytest.fixture(scope="module")
def store_url(backend: str, request: pytest.FixtureRequest) -> str:
    server = request.getfixturevalue("redis_server")
    if backend == "cluster":
        return request.getfixturevalue("redis_cluster").url
    return server.url


@pytest.fixture(scope="module")
def broker(request: pytest.FixtureRequest) -> str:
    """``redis`` (the standalone server) or ``amqp`` (RabbitMQ): which broker
    ``broker_url`` names."""
    return getattr(request, "param", "redis")


@pytest.fixture(scope="module")
def broker_url(broker: str, request: pytest.FixtureRequest) -> str:
    """The Celery broker: the standalone server (kombu has no cluster client), or a
    RabbitMQ vhost of this run for the tests marked ``both_brokers``."""
    if broker == "amqp":
        return request.getfixturevalue("broker_vhost")
    return request.getfixturevalue("redis_server").url


@pytest.fixture
def redis_url(store_url: str, broker_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The data store. Clients given a cluster URL and no broker use CLAW_BROKER_URL."""
    monkeypatch.setenv("CLAW_BROKER_URL", broker_url)
    use_settings()
    return store_url


@pytest.fixture
def r(redis_url: str) -> Client:
    return redis_client(redis_url)


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(request: pytest.FixtureRequest, redis_url: str, namespace: str) -> Iterator[Store]:
    """An empty namespace of ``namespace``'s name: 2 shards, capacity 1,000 unless the test or
    its module says otherwise (``pytestmark = pytest.mark.store(capacity=2000)``). After the
    test its retention and priority rules are cleared (a later maintenance pass of this
    session skips it) and this process forgets its caches of it."""
    marker = request.node.get_closest_marker("store")
    st = Store(redis_url, namespace)
    st.create(**{"capacity": 1000, "n_shards": 2, **(marker.kwargs if marker else {})})
    yield st
    with contextlib.suppress(NamespaceError):  # the test may have dropped it
        cfg = st.config(refresh=True)
        if cfg.retention is not None:
            st.set_retention(None)
        if cfg.priorities is not None:
            st.set_priority_rules(None)
    forget(namespace, dropped=False)


@pytest.fixture
def start_worker(redis_url: str, broker_url: str, tmp_path: Path) -> Iterator:
    workers: list[Worker] = []

    def start(queues: str = "ingest", concurrency: int = 1, **env: str) -> Worker:
        log = tmp_path / f"worker-{len(workers)}.log"
        w = Worker(redis_url, queues, concurrency, log, env, broker_url)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


def _module_worker(queues: str) -> Callable[..., Iterator[Worker]]:
    @pytest.fixture(scope="module")
    def fixture(
        store_url: str, broker_url: str, redis_server: RedisServer, tmp_path_factory
    ) -> Iterator[Worker]:
        log = tmp_path_factory.mktemp("worker") / f"{queues.replace(',', '-')}.log"
        # A cluster store with RabbitMQ as the broker keeps RedBeat's keys in a standalone
        # Redis: the settings refuse to load without one, even in a worker that runs no beat.
        env = {"CLAW_BEAT_REDIS_URL": redis_server.url}
        w = Worker(store_url, queues, 2, log, env, broker_url)
        yield w
        w.stop()

    fixture.__doc__ = f"One shared worker on {queues} (2 pool processes) per test module."
    return fixture


ingest_worker = _module_worker("ingest")
workers = _module_worker("ingest,prefetch")


# ---- RabbitMQ ---------------------------------------------------------------------------
AMQP = os.environ.get("CLAW_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")


def _rabbitmqctl(*args: str) -> None:
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=60)
    if done.returncode:  # e.g. not root: rabbitmqctl needs the node's Erlang cookie
        pytest.fail(
            f"rabbitmqctl {' '.join(args)}: {done.stderr.decode()[-500:]} (run the "
            "tests as a user that may run rabbitmqctl)"
        )


def _vhost() -> Iterator[str]:
    """A fresh vhost on the local RabbitMQ, deleted after use, so durable quorum queues
    carry nothing over between runs (skips if no RabbitMQ runs here)."""
    host = urlsplit(AMQP)
    try:
        socket.create_connection((host.hostname, host.port or 5672), timeout=2).close()
    except OSError as e:
        pytest.skip(
            f"no RabbitMQ at {host.hostname}:{host.port or 5672} ({e}); set CLAW_TEST_AMQP to one"
        )
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl not on PATH: the tests need it to make a vhost of their own")
    vhost = f"claw-test-{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, host.username or "guest", ".*", ".*", ".*")
        yield f"{AMQP.rstrip('/')}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(scope="module")
def amqp_url() -> Iterator[str]:
    """A vhost of its own for one test module (test_rabbitmq counts its queues' depths)."""
    yield from _vhost()


@pytest.fixture(scope="session")
def broker_vhost() -> Iterator[str]:
    """One vhost for every ``both_brokers`` test's amqp run (a vhost costs seconds)."""
    yield from _vhost()

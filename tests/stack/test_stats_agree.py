"""Every reader of a namespace's statistics reports the same figures: ``claw stats``, ``claw
metrics``, the inspector's namespaces page, ``BatchClient.stats`` (and ``claw recipes``)
and a capture gateway's ``/metrics``, all reading one collector
(``orchestrator/inspect/stats.py``), against the figures computed here from the steps
written; and a gateway's page while the store does not answer."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator.cli.exporter import registry_for
from orchestrator.cli.main import app
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.samplestats import Observed
from orchestrator.inspect.stats import Statistics
from orchestrator.web.views import Inspector
from tests.support.gateway import TOKEN, Proc, start_gateway
from tests.support.stepdata import batch, episode, interleave

EPISODES = {0: ("reach", 5), 1: ("reach", 7), 2: ("grasp", 4)}  # task_id, steps
STEPS = sum(n for _, n in EPISODES.values())
RECIPE = {
    "name": "r",
    "batch_size": 4,
    "fields": ["obs"],
    "params": {"policy_version": 3},
    "admission": {"max_staleness": 1},
    "rate_limit": {"samples_per_insert": 1.0, "min_size": 1, "error_buffer": 0},
    "sources": [{"name": "all"}],
}


@pytest.fixture
def namespace(redis_url: str, broker_url: str) -> Iterator[str]:
    """A namespace of three episodes, a recipe with an admission budget, and the counters a
    prefetch fill and a trainer's pops write."""
    ns = f"agree-{uuid.uuid4().hex[:8]}"
    store = Store(redis_url, ns)
    store.create(capacity=1000, n_shards=2)
    eps = [episode(e, n, end="terminated", task_id=t) for e, (t, n) in EPISODES.items()]
    store.commit(batch(interleave(*eps)))
    client = BatchClient(ns, redis_url, broker_url=broker_url)
    try:
        client.register(RECIPE)
        seen = Observed()
        seen.batch(0.02, 4)
        seen.batch(0.3, 4)
        seen.hit_rates(["all"], [STEPS], STEPS)
        client.registry.bump("r", produced=2, sampled=8, popped=1, wait_s=0.5, state="made 2")
        client.registry.bump("r", **seen.fields())
    finally:
        client.close()
    yield ns
    store.r.delete(*store.r.scan_iter(match=f"claw:{{{ns}*"))


def scrape(text: str, namespace: str) -> dict[tuple[str, tuple], float]:
    """Samples of ``namespace`` (and unlabelled ones): (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("namespace", namespace) == namespace:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "namespace"))
                out[(s.name, labels)] = s.value
    return out


@pytest.mark.both_stores
def test_stats_metrics_page_client_and_gateway_agree(
    redis_url, broker_url, namespace, tmp_path: Path
):
    rewards = np.array([e + t / 100 for e, (_, n) in EPISODES.items() for t in range(n)])
    rewards = rewards.astype(np.float32).astype(np.float64)
    (st,) = Statistics(Store(redis_url, namespace).r).collect([namespace]).namespaces
    assert st.info["steps"] == STEPS and st.episodes == len(EPISODES)
    assert st.by_task_id == {"reach": 12, "grasp": 4}
    assert st.reward_mean == pytest.approx(rewards.mean()) and st.memory_bytes > 0

    # claw stats: the collector's figures, as JSON
    cli = CliRunner()
    out = cli.invoke(app, ["--redis-url", redis_url, "stats", "-n", namespace, "--json"])
    assert out.exit_code == 0, out.output
    (shown,) = json.loads(out.output)["namespaces"]
    assert shown == json.loads(json.dumps(st.to_json()))

    # claw metrics
    m = scrape(generate_latest(registry_for(redis_url, broker_url)).decode(), namespace)
    assert m[("claw_steps", ())] == shown["steps"]
    assert m[("claw_capacity_steps", ())] == shown["capacity"]
    assert m[("claw_steps_committed_total", ())] == shown["committed_total"]
    assert m[("claw_episodes", ())] == shown["episodes"]
    assert m[("claw_dead_letters", ())] == shown["dead_letters"]
    assert m[("claw_namespace_memory_bytes", ())] == shown["memory_bytes"]
    assert m[("claw_reward_mean", ())] == shown["reward"]["mean"]
    assert m[("claw_reward_std", ())] == shown["reward"]["std"]
    for d in shown["by_task_id"]:
        assert m[("claw_steps_by_task", (("task_id", d["task_id"]),))] == d["steps"]
    for reason, n in shown["evictions"].items():
        assert m[("claw_evictions_total", (("reason", reason),))] == n

    # the inspector's namespaces page
    inspector = Inspector(redis_url, broker_url)
    try:
        (row,) = inspector.namespaces(prefix=namespace).rows
    finally:
        inspector.close()
    for key, value in (
        ("steps", shown["steps"]),
        ("capacity", shown["capacity"]),
        ("committed", shown["committed_total"]),
        ("episodes", shown["episodes"]),
        ("memory_bytes", shown["memory_bytes"]),
        ("reward_mean", shown["reward"]["mean"]),
        ("reward_std", shown["reward"]["std"]),
        ("dead_letters", shown["dead_letters"]),
        ("evictions", shown["evictions"]),
    ):
        assert row[key] == value, key

    # BatchClient.stats and claw recipes: the recipe figures claw metrics exports
    client = BatchClient(namespace, redis_url, broker_url=broker_url)
    try:
        rs = client.stats()["r"]
    finally:
        client.close()
    out = cli.invoke(app, ["--redis-url", redis_url, "recipes", namespace, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["r"] == rs
    assert (rs["produced"], rs["popped"], rs["sampled_rows"]) == (2, 1, 8)
    recipe = (("recipe", "r"),)
    assert m[("claw_prefetch_batches_produced_total", recipe)] == rs["produced"]
    assert m[("claw_prefetch_batches_popped_total", recipe)] == rs["popped"]
    assert m[("claw_prefetch_depth", recipe)] == rs["depth"]
    assert m[("claw_prefetch_rate_limited", recipe)] == float(rs["rate_limited"])
    assert m[("claw_prefetch_wait_seconds_total", recipe)] == 0.5
    assert m[("claw_sample_seconds_count", recipe)] == 2
    assert m[("claw_sample_seconds_sum", recipe)] == pytest.approx(0.32)
    assert m[("claw_sample_hit_rate", (*recipe, ("source", "all")))] == 1.0
    adm = rs["admission"]
    assert adm["budget"] == (1 + 3 + 1) * 4  # (max_staleness + v + 1) x batch
    assert m[("claw_admission_budget", ())] == adm["budget"]
    assert m[("claw_admission_admitted", ())] == adm["admitted"]

    # a capture gateway of the namespace: the same budget, read from the store
    gw = start_gateway("http://127.0.0.1:9", namespace, tmp_path, redis_url=redis_url)
    try:
        page = httpx.get(
            f"{gw.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )
    finally:
        gw.stop()
    assert page.status_code == 200, page.text
    g = scrape(page.text, namespace)
    assert g[("claw_gateway_admission_budget", ())] == adm["budget"]
    assert g[("claw_gateway_admission_admitted", ())] == adm["admitted"]


def test_gateway_without_a_budget_shows_none(redis_url, tmp_path: Path):
    """No trainer declares a budget: -1, and nothing admitted against one."""
    ns = f"agree-{uuid.uuid4().hex[:8]}"
    Store(redis_url, ns).create(capacity=100, n_shards=1)
    assert Statistics(Store(redis_url, ns).r).admission(ns) is None
    gw: Proc = start_gateway("http://127.0.0.1:9", ns, tmp_path, redis_url=redis_url)
    try:
        page = httpx.get(
            f"{gw.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )
    finally:
        gw.stop()
    g = scrape(page.text, ns)
    assert g[("claw_gateway_admission_budget", ())] == -1
    assert g[("claw_gateway_admission_admitted", ())] == 0


def test_gateway_metrics_answer_while_the_store_does_not(tmp_path: Path):
    """A store that accepts connections and answers nothing (its redis-server stopped with
    SIGSTOP): the page still comes, with this process's own figures and without the
    budget, which it cannot read."""
    ns = f"agree-{uuid.uuid4().hex[:8]}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with RedisServer() as server:
        Store(server.url, ns).create(capacity=100, n_shards=1)
        env = {"CLAW_BROKER_URL": server.url}
        gw = start_gateway("http://127.0.0.1:9", ns, tmp_path, redis_url=server.url, env=env)
        assert server.pid is not None
        try:
            page = httpx.get(f"{gw.url}/metrics", headers=headers, timeout=30)
            assert scrape(page.text, ns)[("claw_gateway_admission_budget", ())] == -1
            os.kill(server.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 120
            while True:  # a page read within BUDGET_FRESH_S shows the last budget read
                page = httpx.get(f"{gw.url}/metrics", headers=headers, timeout=30)
                assert page.status_code == 200, page.text
                g = scrape(page.text, ns)
                if ("claw_gateway_admission_budget", ()) not in g:
                    break
                assert time.monotonic() < deadline, "the page kept a budget it cannot read"
                time.sleep(0.5)
            assert g[("claw_gateway_sessions_total", ())] == 0
            assert ("claw_gateway_record_backlog", ()) in g
        finally:
            os.kill(server.pid, signal.SIGCONT)
            gw.stop()

"""Prometheus metrics of the step store and the Celery queues, computed on each scrape."""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import WSGIApplication as WSGIApp

import redis
from kombu import Connection
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from claw_tasks.broker.app import QUEUES
from claw_tasks.connection import client as connect
from claw_tasks.connection.client import redis_client
from claw_tasks.settings import redact_url
from claw_tasks.store import Store
from orchestrator.delivery import ratelimit, rollouts
from orchestrator.delivery.registry import Registry
from orchestrator.inspect.namespaces import (
    UnreadableNamespace,
    memory_by_namespace,
    namespace_stats,
)
from orchestrator.maintenance.lifecycle import list_namespaces

log = logging.getLogger(__name__)
_TIMEOUT = 5.0


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class ClawCollector(Collector):
    """Reads Redis (the store) and the broker on every `collect()`; never raises."""

    def __init__(self, redis_url: str, broker_url: str) -> None:
        self.redis_url = redis_url
        self.broker_url = broker_url
        self._r = redis_client(redis_url, socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT)
        self._lock = threading.Lock()  # scrapes may overlap; one Redis walk at a time

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            up = _gauge("claw_up", "1 if the component answered this scrape", ["component"])
            out: list[Metric] = []
            try:
                out += self._store_metrics()
                up.add_metric(["store"], 1)
            except (redis.RedisError, OSError) as e:
                log.warning("claw metrics: store at %s: %s", redact_url(self.redis_url), e)
                up.add_metric(["store"], 0)
            try:
                out.append(self._queue_depths())
                up.add_metric(["broker"], 1)
            except Exception as e:  # kombu raises transport-specific errors
                log.warning("claw metrics: broker at %s: %s", redact_url(self.broker_url), e)
                up.add_metric(["broker"], 0)
        yield from out
        yield up

    def _store_metrics(self) -> list[Metric]:
        used = _gauge("claw_redis_used_memory_bytes", "used_memory of the store's Redis")
        used.add_metric([], float(sum(u for u, _ in connect.memory(self._r))))  # every master
        ns = ["namespace"]
        fams = {
            "steps": _gauge("claw_steps", "live steps stored", ns),
            "capacity": _gauge("claw_capacity_steps", "namespace capacity in steps", ns),
            "dead": _gauge("claw_dead_letters", "entries in the dead-letter stream", ns),
            "memory": _gauge("claw_namespace_memory_bytes", "Redis memory of the keys", ns),
            "episodes": _gauge("claw_episodes", "episodes with live steps", ns),
            "mean": _gauge("claw_reward_mean", "mean reward of the live steps", ns),
            "std": _gauge("claw_reward_std", "reward standard deviation", ns),
            "task": _gauge("claw_steps_by_task", "live steps per task_id", [*ns, "task_id"]),
            "agent": _gauge("claw_steps_by_agent", "live steps per agent_id", [*ns, "agent_id"]),
            "payload": _gauge(
                "claw_payload_bytes_per_step",
                "mean bytes of a payload field per step, stored (its frame, when compressed) "
                "and raw (decoded), over up to 512 live steps",
                [*ns, "field", "kind"],
            ),
        }
        committed = CounterMetricFamily(
            "claw_steps_committed", "steps committed since the namespace was created", labels=ns
        )
        evictions = CounterMetricFamily(
            "claw_evictions",
            "steps evicted, by reason (ttl, cap, manual, ring)",
            labels=[*ns, "reason"],
        )
        readable = _gauge("claw_namespace_readable", "0 if the namespace does not decode", ns)
        rl = [*ns, "recipe"]
        prefetch = {
            "depth": _gauge("claw_prefetch_depth", "batches ready in the recipe's queue", rl),
            "limited": _gauge("claw_prefetch_rate_limited", "1 while prefetch waits", rl),
            "produced": CounterMetricFamily(
                "claw_prefetch_batches_produced", "batches made by prefetch", labels=rl
            ),
            "popped": CounterMetricFamily(
                "claw_prefetch_batches_popped", "batches taken by trainers", labels=rl
            ),
            "rollouts": CounterMetricFamily(
                "claw_rollouts_formed", "rollouts formed by an on-policy recipe", labels=rl
            ),
            "stale": CounterMetricFamily(
                "claw_rollout_dropped_stale",
                "steps of an on-policy recipe older than its max_lag, never served",
                labels=rl,
            ),
        }
        memory = memory_by_namespace(self._r)
        for name in list_namespaces(self._r):
            try:
                s = namespace_stats(Store(self._r, name), memory.get(name, 0))
            except UnreadableNamespace as e:
                log.warning("claw metrics: %s", e)
                readable.add_metric([name], 0)
                continue
            readable.add_metric([name], 1)
            fams["steps"].add_metric([name], s.info["steps"])
            fams["capacity"].add_metric([name], s.info["capacity"])
            fams["dead"].add_metric([name], s.info["dead_letters"])
            fams["memory"].add_metric([name], s.memory_bytes)
            fams["episodes"].add_metric([name], s.episodes)
            committed.add_metric([name], s.info["committed_total"])
            for reason, n in s.evictions.items():
                evictions.add_metric([name, reason], n)
            if s.reward_mean is not None and s.reward_std is not None:
                fams["mean"].add_metric([name], s.reward_mean)
                fams["std"].add_metric([name], s.reward_std)
            for task, n in s.by_task_id.items():
                fams["task"].add_metric([name, task or ""], n)
            for agent, n in s.by_agent_id.items():
                fams["agent"].add_metric([name, agent or ""], n)
            for field, size in s.payload.items():
                fams["payload"].add_metric([name, field, "stored"], size["stored"])
                fams["payload"].add_metric([name, field, "raw"], size["raw"])
            self._prefetch_metrics(Registry(Store(self._r, name)), prefetch)
        return [used, committed, evictions, readable, *fams.values(), *prefetch.values()]

    def _prefetch_metrics(self, reg: Registry, fams: dict[str, Metric]) -> None:
        names = reg.names()
        inserted = reg.inserted() if names else 0
        for recipe in names:
            entry = reg.get(recipe)
            if entry is None:
                continue
            c = reg.counts(recipe)
            r = entry.recipe
            labels = [reg.ns, recipe]
            waits = not ratelimit.check(
                r.rate_limit, inserted, float(c.get("sampled", 0)), r.batch_size
            )
            fams["depth"].add_metric(labels, self._r.llen(reg.queue(recipe)))
            fams["limited"].add_metric(labels, float(waits))
            fams["produced"].add_metric(labels, float(c.get("produced", 0)))
            fams["popped"].add_metric(labels, float(c.get("popped", 0)))
            if r.rollout is not None:
                ro = rollouts.read_state(reg, recipe)
                fams["rollouts"].add_metric(labels, float(ro.no))
                fams["stale"].add_metric(labels, float(ro.dropped_stale))

    def _queue_depths(self) -> Metric:
        """Messages waiting per Celery queue (all priority levels; Redis or RabbitMQ)."""
        depth = _gauge("claw_queue_depth", "messages waiting in the Celery queue", ["queue"])
        with Connection(self.broker_url, connect_timeout=_TIMEOUT) as conn:
            for queue in QUEUES:
                # A channel per queue: AMQP closes the channel on a failed passive declare.
                with conn.channel() as channel:
                    try:
                        waiting = channel.queue_declare(queue=queue, passive=True).message_count
                    except conn.channel_errors:  # not declared yet: nothing waiting
                        waiting = 0
                depth.add_metric([queue], waiting)
        return depth


def registry_for(redis_url: str, broker_url: str) -> CollectorRegistry:
    """A registry holding only Claw's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClawCollector(redis_url, broker_url))
    return registry


def require_token(app: WSGIApp, token: str) -> WSGIApp:
    """``app`` answering only requests with ``Authorization: Bearer <token>`` (401 else;
    the scheme is case-insensitive, as HTTP says; the token compared as bytes)."""
    expected = token.encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        sent = given.strip().encode("latin-1", "replace")  # WSGI headers are latin-1 str
        if scheme.lower() == "bearer" and hmac.compare_digest(sent, expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("WWW-Authenticate", 'Bearer realm="claw"'), ("Content-Type", "text/plain")],
        )
        return [b"a bearer token is required (Authorization: Bearer $CLAW_METRICS_TOKEN)\n"]

    return guarded


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape is noise


def serve(
    port: int, redis_url: str, broker_url: str, addr: str = "127.0.0.1", token: str | None = None
) -> WSGIServer:
    """Serve /metrics on `addr:port` from a daemon thread; returns the server (`.shutdown()`).
    With ``token``, a scrape must send it as a bearer token."""
    app = make_wsgi_app(registry_for(redis_url, broker_url))
    if token:
        app = require_token(app, token)
    server = make_server(addr, port, app, _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="claw-metrics", daemon=True).start()
    return server

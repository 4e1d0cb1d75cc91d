"""Prometheus metrics of the step store and the Celery queues, computed on each scrape: the
store's figures from one :meth:`Statistics.collect <orchestrator.inspect.stats.Statistics.
collect>` (what ``claw stats`` and the web inspector show), one section of families each."""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import WSGIApplication as WSGIApp

import numpy as np
import redis
from kombu import Connection
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from claw_tasks.broker.app import QUEUES
from claw_tasks.connection.client import redis_client
from claw_tasks.settings import redact_url
from orchestrator.inspect.stats import Census, Statistics

log = logging.getLogger(__name__)
_TIMEOUT = 5.0


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class ClawCollector(Collector):
    """Reads Redis (the store) and the broker on every `collect()`; never raises."""

    def __init__(self, redis_url: str, broker_url: str) -> None:
        self.redis_url = redis_url
        self.broker_url = broker_url
        r = redis_client(redis_url, socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT)
        self._stats = Statistics(r)
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
        """Every figure of the store's namespaces, from one :meth:`Statistics.collect`."""
        census = self._stats.collect(recipes=True, quality=True)
        out = _redis_metrics(census)
        for section in (_namespace_metrics, _recipe_metrics, _admission_metrics, _quality_metrics):
            out += section(census)
        return out

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


def _redis_metrics(census: Census) -> list[Metric]:
    used = _gauge("claw_redis_used_memory_bytes", "used_memory of the store's Redis")
    used.add_metric([], float(census.used_memory))
    limit = _gauge("claw_redis_maxmemory_bytes", "maxmemory of the store's Redis (0: none)")
    limit.add_metric([], float(sum(m for _, m in census.nodes)))
    ratio = _gauge(
        "claw_redis_memory_used_ratio",
        "used_memory / maxmemory of the fullest master that has a maxmemory",
    )
    if any(m for _, m in census.nodes):
        ratio.add_metric([], max(u / m for u, m in census.nodes if m))
    return [used, limit, ratio]


def _namespace_metrics(census: Census) -> list[Metric]:
    """Steps, memory, episodes, rewards, counts and payload sizes of each namespace."""
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
    unreplicated = CounterMetricFamily(
        "claw_ingest_unreplicated",
        "ingest deliveries not confirmed because a commit reached fewer replicas than "
        "CLAW_INGEST_REPLICAS in time (each retried)",
        labels=ns,
    )
    evictions = CounterMetricFamily(
        "claw_evictions",
        "steps evicted, by reason (ttl, cap, manual, ring)",
        labels=[*ns, "reason"],
    )
    readable = _gauge("claw_namespace_readable", "0 if the namespace does not decode", ns)
    for name, why in census.unreadable.items():
        log.warning("claw metrics: %s", why)
        readable.add_metric([name], 0)
    for s in census.namespaces:
        name = s.namespace
        readable.add_metric([name], 1)
        for k, v in (("steps", "steps"), ("capacity", "capacity"), ("dead", "dead_letters")):
            fams[k].add_metric([name], s.info[v])
        fams["memory"].add_metric([name], s.memory_bytes)
        fams["episodes"].add_metric([name], s.episodes)
        committed.add_metric([name], s.info["committed_total"])
        unreplicated.add_metric([name], s.info["unreplicated_total"])
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
    return [committed, unreplicated, evictions, readable, *fams.values()]


def _recipe_families() -> dict[str, Metric]:
    rl = ["namespace", "recipe"]
    counters = {
        "produced": ("claw_prefetch_batches_produced", "batches made by prefetch"),
        "popped": ("claw_prefetch_batches_popped", "batches taken by trainers"),
        "rollouts": ("claw_rollouts_formed", "rollouts formed by an on-policy recipe"),
        "stale": (
            "claw_rollout_dropped_stale",
            "steps of an on-policy recipe older than its max_lag, never served",
        ),
        "wait": (
            "claw_prefetch_wait_seconds",
            "seconds trainers' pops waited on the recipe's empty queue",
        ),
    }
    return {
        "depth": _gauge("claw_prefetch_depth", "batches ready in the recipe's queue", rl),
        "limited": _gauge("claw_prefetch_rate_limited", "1 while prefetch waits", rl),
        **{k: CounterMetricFamily(n, doc, labels=rl) for k, (n, doc) in counters.items()},
        "hit": _gauge(
            "claw_sample_hit_rate",
            "a source's candidates over the namespace's live steps (the last fill's)",
            [*rl, "source"],
        ),
        "lat": HistogramMetricFamily(
            "claw_sample_seconds",
            "time to make one batch in a prefetch worker (sample, read, augment, frame)",
            labels=rl,
        ),
        "rows": HistogramMetricFamily("claw_sample_batch_rows", "rows per batch made", labels=rl),
        "stale_mean": _gauge(
            "claw_served_staleness_mean",
            "an admission recipe's batches: mean of (version - turn's policy version)",
            rl,
        ),
        "stale_max": _gauge(
            "claw_served_staleness_max",
            "an admission recipe's batches: the oldest turn served, in versions",
            rl,
        ),
    }


def _recipe_metrics(census: Census) -> list[Metric]:
    """Each recipe's queue, counters, fill measurements (``BatchClient.stats``' figures)."""
    fams = _recipe_families()
    for s in census.namespaces:
        for recipe, st in s.recipes.items():
            labels = [s.namespace, recipe]
            fams["depth"].add_metric(labels, st.depth)
            fams["limited"].add_metric(labels, float(not st.verdict))
            fams["produced"].add_metric(labels, float(st.produced))
            fams["popped"].add_metric(labels, float(st.popped))
            if st.rollout is not None:
                fams["rollouts"].add_metric(labels, float(st.rollout.no))
                fams["stale"].add_metric(labels, float(st.rollout.dropped_stale))
            fams["wait"].add_metric(labels, st.wait_seconds)
            if st.served_staleness is not None:
                fams["stale_mean"].add_metric(labels, st.served_staleness["mean"] or 0.0)
                fams["stale_max"].add_metric(labels, float(st.served_staleness["max"]))
            for source, rate in st.hit_rates.items():
                fams["hit"].add_metric([*labels, source], rate)
            fams["lat"].add_metric(labels, *st.sample_seconds)
            fams["rows"].add_metric(labels, *st.batch_rows)
    return list(fams.values())


def _admission_metrics(census: Census) -> list[Metric]:
    """The staleness budget each namespace declares and its counters."""
    ns = ["namespace"]
    fams = {
        "budget": _gauge(
            "claw_admission_budget",
            "the staleness budget (max_staleness + v + 1) x batch, in trajectories",
            ns,
        ),
        "admitted": _gauge(
            "claw_admission_admitted", "trajectories running or accepted (counted)", ns
        ),
        "version": _gauge("claw_admission_version", "the trainer's declared version", ns),
        **{
            k: CounterMetricFamily(f"claw_admission_{k}", doc, labels=ns)
            for k, doc in (
                ("started", "trajectories the gateways admitted"),
                ("waited", "first calls of new trajectories that waited for the budget"),
                ("refused", "first calls refused (429) after waiting"),
                ("released", "slots given back (stale or dropped trajectories)"),
                ("expired", "admitted trajectories expired: no turn nor reward in time"),
                ("lapsed", "rewarded trajectories the version moved past before one was served"),
            )
        },
        "waiting": _gauge(
            "claw_admission_waiting", "rewarded trajectories not served yet (holding slots)", ns
        ),
        **{
            k: CounterMetricFamily(f"claw_admission_{k}_trajectories", doc, labels=[*ns, "turns"])
            for k, doc in (
                ("rewarded", "trajectories rewarded, by turn count (bucket: at most)"),
                ("stale", "rewarded trajectories released unserved, by turn count (bucket)"),
            )
        },
    }
    plain = ("budget", "admitted", "version", "waited", "refused", "released", "expired")
    for s in census.namespaces:
        if s.admission is None:
            continue
        for k in (*plain, "lapsed", "waiting"):
            fams[k].add_metric([s.namespace], float(s.admission[k]))
        fams["started"].add_metric([s.namespace], float(s.admission["total"]))
        for k in ("rewarded", "stale"):
            for b, n in s.admission[f"{k}_by_turns"].items():
                fams[k].add_metric([s.namespace, b], float(n))
    return list(fams.values())


def _quality_families() -> dict[str, Metric]:
    ns, nf = ["namespace"], ["namespace", "field"]
    return {
        "count": _gauge("claw_quality_values", "finite values of a field in live steps", nf),
        "nonfinite": _gauge(
            "claw_quality_nonfinite_values", "NaN or inf values of a field", [*nf, "kind"]
        ),
        "min": _gauge("claw_quality_min", "a field's smallest finite value", nf),
        "max": _gauge("claw_quality_max", "a field's largest finite value", nf),
        "mean": _gauge("claw_quality_mean", "a field's mean", nf),
        "std": _gauge("claw_quality_std", "a field's standard deviation", nf),
        "hist": HistogramMetricFamily(
            "claw_quality_field", "a field's values in its fixed bins", labels=nf
        ),
        "steps": _gauge(
            "claw_quality_steps", "live steps per value of a key", [*ns, "key", "value"]
        ),
        "window": _gauge(
            "claw_quality_window_steps",
            "live steps per value of a key committed in the window (recent: the newest "
            "window; trailing: the ones before it)",
            [*ns, "key", "value", "window"],
        ),
        "share": _gauge(
            "claw_quality_window_share",
            "a value's share of the window's steps",
            [*ns, "key", "value", "window"],
        ),
        "reward_mean": _gauge(
            "claw_quality_reward_mean", "mean reward of the window's steps", [*ns, "window"]
        ),
        "reward_std": _gauge(
            "claw_quality_reward_std", "reward standard deviation in the window", [*ns, "window"]
        ),
        "reward_count": _gauge("claw_quality_reward_steps", "steps in the window", [*ns, "window"]),
        "at": _gauge("claw_quality_updated", "time of the last quality pass (unix)", ns),
    }


def _quality_metrics(census: Census) -> list[Metric]:
    fams = _quality_families()
    for s in census.namespaces:
        if s.quality is not None:
            _quality_pass(s.namespace, s.quality, fams)
    return list(fams.values())


def _quality_pass(ns: str, summary: dict[str, Any], fams: dict[str, Metric]) -> None:
    """The last quality pass of ``ns`` (``claw.maintenance.quality``) as gauges."""
    fams["at"].add_metric([ns], summary["at"])
    for f, st in summary["fields"].items():
        labels = [ns, f]
        fams["count"].add_metric(labels, st["count"])
        fams["nonfinite"].add_metric([*labels, "nan"], st["nan"])
        fams["nonfinite"].add_metric([*labels, "inf"], st["inf"])
        for k in ("min", "max", "mean", "std"):
            if st[k] is not None:
                fams[k].add_metric(labels, st[k])
        if st["edges"]:
            lo, hi = st["edges"]
            bins = len(st["hist"]) - 2
            width = (hi - lo) / bins
            counts = np.cumsum(st["hist"])  # below lo, the bins, above hi
            bounds = [lo, *(lo + width * (i + 1) for i in range(bins))]
            buckets = [(f"{b:.6g}", float(c)) for b, c in zip(bounds, counts[:-1], strict=True)]
            total = (st["mean"] or 0.0) * st["count"]
            fams["hist"].add_metric(labels, [*buckets, ("+Inf", float(counts[-1]))], total)
    for key, values in summary["counts"].items():
        for value, n in values.items():
            fams["steps"].add_metric([ns, key, value], n)
    for key, values in summary["windows"].items():
        recent = sum(v[0] for v in values.values())
        trailing = sum(sum(v[1:]) for v in values.values())
        for value, per in values.items():
            for window, n, total in (
                ("recent", per[0], recent),
                ("trailing", sum(per[1:]), trailing),
            ):
                fams["window"].add_metric([ns, key, value, window], n)
                if total:
                    fams["share"].add_metric([ns, key, value, window], n / total)
    windows = (("recent", summary["rewards"][0]), ("trailing", summary["reward_trailing"]))
    for window, st in windows:
        fams["reward_count"].add_metric([ns, window], st["count"])
        if st["mean"] is not None:
            fams["reward_mean"].add_metric([ns, window], st["mean"])
            fams["reward_std"].add_metric([ns, window], st["std"])


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

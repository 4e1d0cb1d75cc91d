"""The gateway's Prometheus metrics, in a registry of its own (one per app, so tests can
run several gateways in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "claw_gateway_requests",
            "Calls answered, by route and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "claw_gateway_upstream_seconds",
            "Time to the upstream's response headers",
            registry=r,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60),
        )
        self.recorded = Counter(
            "claw_gateway_recorded_turns", "Calls recorded as steps", registry=r
        )
        self.retokenized = Counter(
            "claw_gateway_retokenized_turns",
            "Recorded turns whose token ids came from the gateway's tokenizer",
            registry=r,
        )
        self.unrecorded = Counter(
            "claw_gateway_unrecorded_calls",
            "Successful calls not recorded, by reason (uncapturable: no log-probs or ids; "
            "malformed: a 200 reply that is not the API's shape; too_large: a reply over "
            "CLAW_GATEWAY_MAX_REPLY_BYTES, passed through; queue_full: the recorder's queue "
            "(calls or CLAW_GATEWAY_QUEUE_BYTES); finished: the reward was posted through "
            "another gateway; error)",
            ["reason"],
            registry=r,
        )
        self.rewarded = Counter(
            "claw_gateway_rewarded_trajectories", "Trajectories given a reward", registry=r
        )
        self.backlog = Gauge(
            "claw_gateway_record_backlog", "Calls waiting to be recorded", registry=r
        )

    def track_backlog(self, size: Callable[[], int]) -> None:
        self.backlog.set_function(size)

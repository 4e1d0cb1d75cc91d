"""The gateway's Prometheus metrics, in a registry of its own (one per app, so tests can
run several gateways in one process).

What this process did (calls answered, turns recorded, trajectories admitted here) it counts
itself; what is the namespace's (the admission budget and what is admitted against it,
shared by every gateway) the app reads from the store at each scrape, decoded by
:func:`orchestrator.delivery.admission.state_of` as ``claw metrics``' figure is, so the two
agree, rather than the one this gateway saw last."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class GatewayMetrics:
    """The gateway's metrics, by responsibility: traffic, recording, admission."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._traffic()
        self._recording()
        self._admission()
        self.budget = AdmissionGauges()
        self.registry.register(self.budget)

    def _traffic(self) -> None:
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
        self.sessions = Counter(
            "claw_gateway_sessions", "Sessions created (POST /sessions)", registry=r
        )

    def _recording(self) -> None:
        r = self.registry
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
        self.spooled_bytes = Gauge(
            "claw_gateway_spool_bytes",
            "Bytes in the spool: answered calls the store may not have yet (0 with no spool)",
            registry=r,
        )
        self.replayed = Counter(
            "claw_gateway_spool_replayed_calls",
            "Answered calls found unsettled in the spool at start and recorded again",
            registry=r,
        )
        self.spool_dropped = Counter(
            "claw_gateway_spool_dropped_calls",
            "Answered calls not spooled: the spool was full (CLAW_GATEWAY_SPOOL_BYTES) or "
            "unwritable; recorded from memory only, so lost to a SIGKILL before the store "
            "has them",
            registry=r,
        )

    def _admission(self) -> None:
        """What this gateway's gate did; the budget itself is :class:`AdmissionGauges`'."""
        r = self.registry
        self.admitted = Counter(
            "claw_gateway_admitted_trajectories",
            "New trajectories this gateway admitted under the namespace's staleness budget",
            registry=r,
        )
        self.waited = Counter(
            "claw_gateway_admission_waited_calls",
            "First calls of new trajectories that had to wait for the staleness budget",
            registry=r,
        )
        self.refused = Counter(
            "claw_gateway_admission_refused_calls",
            "First calls of new trajectories refused (429) after waiting for the budget",
            registry=r,
        )
        self.released = Counter(
            "claw_gateway_admission_released_slots",
            "Budget slots given back: trajectories rewarded too old to be served, or that the "
            "version moved past before a fill served them",
            registry=r,
        )
        self.expired = Counter(
            "claw_gateway_admission_expired_trajectories",
            "Admitted trajectories this gateway expired: no turn nor reward within "
            "CLAW_GATEWAY_ADMISSION_EXPIRY seconds (their slots given back)",
            registry=r,
        )
        self.unchecked = Counter(
            "claw_gateway_admission_unchecked_calls",
            "Shared-token calls forwarded without an admission check: the store did not "
            "answer within 2 s",
            registry=r,
        )

    def track_backlog(self, size: Callable[[], int]) -> None:
        self.backlog.set_function(size)

    def track_spool(self, size: Callable[[], int]) -> None:
        self.spooled_bytes.set_function(size)


class AdmissionGauges(Collector):
    """The namespace's staleness budget and the trajectories admitted against it (-1 and 0
    while no trainer declares one), as last read: the app reads them before it renders a
    page (:meth:`update`), so rendering never waits on the store. Absent from the page while
    the store does not answer: a stale figure would pass for a current one."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.known = False

    def update(self, state: dict[str, Any] | None, known: bool = True) -> None:
        self.state, self.known = state, known

    def collect(self) -> Iterator[Metric]:
        if not self.known:
            return
        state = self.state
        budget = GaugeMetricFamily(
            "claw_gateway_admission_budget",
            "The staleness budget (max_staleness + v + 1) x batch trajectories (-1: no "
            "trainer declared one)",
        )
        budget.add_metric([], -1.0 if state is None else float(state["budget"]))
        admitted = GaugeMetricFamily(
            "claw_gateway_admission_admitted",
            "Trajectories running or accepted against the budget",
        )
        admitted.add_metric([], 0.0 if state is None else float(state["admitted"]))
        yield budget
        yield admitted

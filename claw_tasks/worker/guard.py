"""The worker's guard: every task message is checked before Celery parses it.

Celery takes some malformed messages (a body that is not ``[args, kwargs, embed]``, a
non-numeric ``timelimit``, ...) for an unrecoverable error and exits, and the message,
redelivered, kills the next worker too. ``GuardedConsumer`` (``worker_consumer``) checks
the envelope, headers and body shape first and dead-letters what fails, with a reason
and a count (``claw_tasks.worker.deadletter``), then acks it: the worker never sees it.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

import redis
from celery.utils.time import maybe_iso8601
from celery.worker.consumer import Consumer
from kombu.serialization import loads

from claw_tasks.broker import rabbitmq as amqp
from claw_tasks.connection.client import redis_client
from claw_tasks.format.message import TASK, Rejected
from claw_tasks.settings import IngestLimits, get_settings
from claw_tasks.worker.ingest import parse_message, reject

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/x-msgpack"
MAX_ETA = timedelta(minutes=10)  # retries wait at most a minute; nothing else sets an eta
_STR_HEADERS = (
    "id",
    "root_id",
    "parent_id",
    "group",
    "shadow",
    "argsrepr",
    "kwargsrepr",
    "origin",
    "lang",
)
_EMBED = frozenset({"callbacks", "errbacks", "chain", "chord"})
EVENT_HOLD_S = 0.05
"""How long the worker holds its task events before one message sends them all. Celery
sends them on the next loop turn, ~3 PUBLISHes per task (received, started, succeeded);
held this long, one carries all the tasks of the last 50 ms, which Flower still shows
(docs/benchmarks.md, "Per-message costs of image ingest")."""


def _number_or_none(v: Any) -> bool:
    return v is None or (
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    )


def check_headers(headers: Any, task_names: Any, routes: dict[str, Any], queue: Any) -> str:
    """The task name of a protocol-2 message whose headers Celery can parse; Rejected else."""
    if not isinstance(headers, dict):
        raise Rejected("headers", f"headers are {type(headers).__name__}, not a map")
    name = headers.get("task")
    if not isinstance(name, str) or not name.startswith("claw") or name not in task_names:
        raise Rejected("task", f"task {name!r:.80} is not a Claw task this worker runs")
    expected = next((r.get("queue") for p, r in routes.items() if fnmatch.fnmatch(name, p)), None)
    if expected is not None and queue != expected:
        raise Rejected("task", f"task {name} came on queue {queue!r:.40}, not {expected}")
    if not isinstance(headers.get("id"), str) or not 0 < len(headers["id"]) <= 255:
        raise Rejected("headers", f"task id {headers.get('id')!r:.80}: a string of 1-255 chars")
    for k in _STR_HEADERS:
        if not isinstance(headers.get(k), str | None):
            raise Rejected("headers", f"header {k!r} is {type(headers[k]).__name__}, not a string")
    tl = headers.get("timelimit")
    if tl is not None and not (
        isinstance(tl, list | tuple) and len(tl) == 2 and all(map(_number_or_none, tl))
    ):
        raise Rejected("headers", f"timelimit {tl!r:.80}: expected [soft, hard] seconds or None")
    if name == TASK and tl is not None and any(t is not None for t in tl):
        raise Rejected("headers", "an ingest message sets no time limit (a kill loses it)")
    if not isinstance(headers.get("stamped_headers"), list | None) or not isinstance(
        headers.get("stamps"), dict | None
    ):
        raise Rejected("headers", "stamped_headers must be a list and stamps a map")
    for k in ("group_index", "replaced_task_nesting"):
        v = headers.get(k)
        if v is not None and (type(v) is not int or v < 0):
            raise Rejected("headers", f"header {k!r} is {v!r:.40}, not a non-negative integer")
    retries = headers.get("retries", 0)
    if type(retries) is not int or retries < 0:
        raise Rejected("headers", f"retries {retries!r:.40}: a non-negative integer")
    for k in ("ignore_result",):
        if not isinstance(headers.get(k), bool | None):
            raise Rejected("headers", f"header {k!r} is not a bool")
    for k in ("eta", "expires"):
        v = headers.get(k)
        if v is None:
            continue
        if name == TASK and k == "expires":
            raise Rejected("headers", "an ingest message never expires (it would vanish)")
        try:
            when = maybe_iso8601(v) if isinstance(v, str) else None
        except (ValueError, OverflowError, TypeError):
            when = None
        if when is None:
            raise Rejected("headers", f"{k} {v!r:.80}: not an ISO 8601 time")
        if k == "eta":
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
            if when - datetime.now(UTC) > MAX_ETA:
                raise Rejected("headers", f"eta {v!r:.40} is more than {MAX_ETA} ahead")
    return name


def check_body(body: Any) -> tuple[list[Any], dict[str, Any]]:
    """``[args, kwargs, embed]`` with no callbacks, errbacks, chain or chord: a message must
    not make the worker run other tasks after it."""
    if not isinstance(body, list | tuple) or len(body) != 3:
        raise Rejected("body", f"body is {type(body).__name__}, expected [args, kwargs, embed]")
    args, kwargs, embed = body
    if not isinstance(args, list | tuple):
        raise Rejected("body", f"args are {type(args).__name__}, not a list")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise Rejected("body", "kwargs are not a map with string keys")
    if embed is not None and (
        not isinstance(embed, dict) or set(embed) - _EMBED or any(embed.values())
    ):
        raise Rejected("body", "embed carries callbacks, errbacks, a chain or a chord")
    return list(args), kwargs


@cache
def _claw() -> tuple[redis.Redis, IngestLimits]:
    s = get_settings()
    return redis_client(s.redis_url), s.limits


def dead_letter_raw(data: bytes, reason: str) -> bool:
    """Record a broker item no message could be made of; False if Redis cannot take it."""
    r, limits = _claw()
    log.warning("refused a broker item: %s", reason)
    try:
        reject(r, Rejected("envelope", reason), limits, payload=data)
    except redis.RedisError:
        log.exception("could not dead-letter a broker item")
        return False
    return True


class GuardedConsumer(Consumer):
    """Celery's consumer with ``check`` in front of every task message, and Celery's own
    rejections (unknown task, undecodable body) dead-lettered and counted too. Task
    events go out in bursts, ``EVENT_HOLD_S`` apart."""

    _held_since: float | None = None  # when the pending send was scheduled

    def on_send_event_buffered(self) -> None:
        if not self.hub:
            return
        now = time.monotonic()
        # A send long overdue (its timer lost to a reset) must not strand the events.
        if self._held_since is None or now - self._held_since > 20 * EVENT_HOLD_S:
            self._held_since = now
            self.hub.call_later(EVENT_HOLD_S, self._send_held_events)

    def _send_held_events(self) -> None:
        self._held_since = None
        self._flush_events()

    def shutdown(self) -> None:
        self._flush_events()  # what is held goes out before the dispatcher closes
        super().shutdown()

    def check(self, message: Any) -> None:
        if message.content_type != CONTENT_TYPE or message.content_encoding != "binary":
            raise Rejected(
                "content-type",
                f"content type {message.content_type!r:.60} / encoding "
                f"{message.content_encoding!r:.30}: tasks are {CONTENT_TYPE}, binary",
            )
        queue = amqp.queue_of((message.delivery_info or {}).get("routing_key"))
        if (n := amqp.delivery_count(message.headers)) >= amqp.MAX_DELIVERIES:
            raise Rejected("poison", f"delivered {n + 1} times; each time no worker acked it")
        routes = self.app.conf.task_routes or {}
        name = check_headers(message.headers, self.app.tasks, routes, queue)
        try:
            body = loads(message.body, CONTENT_TYPE, "binary", accept={CONTENT_TYPE})
        except Exception as e:
            raise Rejected("body", f"body does not decode: {type(e).__name__}: {e}") from None
        args, kwargs = check_body(body)
        if name == TASK:
            parse_message(args, kwargs, _claw()[1])

    def create_task_handler(self, *a: Any, **kw: Any) -> Any:
        handle = super().create_task_handler(*a, **kw)

        def on_task_received(message: Any) -> None:
            try:
                self.check(message)
            except Rejected as e:
                return self.dead_letter(message, e)
            except Exception as e:  # the guard itself must not stop the worker
                log.exception("checking a message failed")
                return self.dead_letter(message, Rejected("guard", f"{type(e).__name__}: {e}"))
            try:
                handle(message)
            except Exception as e:  # Celery could not take it after all
                log.exception("Celery could not take a message that passed the guard")
                reason = f"Celery could not take it: {type(e).__name__}: {e}"
                self.dead_letter(message, Rejected("celery", reason))

        return on_task_received

    def dead_letter(self, message: Any, e: Rejected) -> None:
        """Record the message with its reason, then ack it. If Redis cannot take the record,
        the message goes back to the queue (it is not dropped)."""
        r, limits = _claw()
        log.warning("refused a message (%s): %s", e.code, e.reason)
        body = message.body if isinstance(message.body, bytes) else None
        extra = {"payload": body, "content_type": message.content_type}
        headers = message.headers if isinstance(message.headers, dict) else {}
        if isinstance(headers.get("task"), str):
            extra["task"] = headers["task"]
        try:
            reject(r, e, limits, **extra)
        except redis.RedisError:
            log.exception("could not dead-letter a refused message; requeued")
            message.reject(requeue=True)
            return
        message.ack()

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self.dead_letter(message, Rejected("task", "not a task message (no task header)"))

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        self.dead_letter(message, Rejected("task", f"unknown task: {exc}"))

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self.dead_letter(message, Rejected("headers", f"invalid task message: {exc}"))

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self.dead_letter(message, Rejected("body", f"undecodable message: {exc}"))

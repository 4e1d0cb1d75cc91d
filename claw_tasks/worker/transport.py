"""kombu's Redis transport for Claw's broker, hardened: a broker outage must not kill a worker.

Why: when the broker connection drops while a worker holds unacknowledged messages,
Celery's consumer first ``collect()``s the connection and then ``close()``s it. If the
first pass aborts early (the outstanding BRPOP read fails), the default channel stays
half-open while ``collect`` detaches its transport (``transport.client = None``); the
second pass then restores the unacked messages through a new pool built from
``transport.client.hostname`` and dies with ``AttributeError: 'NoneType' object has no
attribute 'hostname'`` — an "Unrecoverable error" that stops the worker.

Here a detached channel reports a *connection* error instead, which kombu's close path
already tolerates. Nothing is lost: the messages stay in the broker's ``unacked`` hash and
the visibility sweep (``unacked_restore_interval``) requeues them once they are
``visibility_timeout`` old; the ingest commit is idempotent, so a redelivery writes
nothing twice.

And a guard where kombu turns a queued item into a message: kombu builds a ``Message``
from the envelope before any Celery hook runs, and an envelope it cannot build one from
(headers that are not a map, an undecodable body) raises out of the event loop and stops
the worker too. Such an envelope is dead-lettered with its reason instead (it was already
popped from the queue: the dead letter is its record; see ``claw_tasks.worker.guard``).
The guard builds the message once and hands it on (kombu's own callback would build it
again: a second base64 and JSON decode of every envelope).

And one synchronous client per channel: kombu builds a new ``redis.Redis`` (over the
channel's pool) for every ack, unacked-index write, publish and task event, ~5 % of the
worker main process's time under image ingest (docs/benchmarks.md). The channel keeps one
until its pool changes (kombu replaces the pool after a fork or a reconnect).

The transport is registered under kombu's own ``redis`` and ``rediss`` names
(``TRANSPORT_ALIASES``, kombu's registry of transports by URL scheme) when the worker app
is built (``claw_tasks.worker.app``), so URLs, TLS defaults and Flower's broker view stay
exactly as with the stock transport. Clients only publish: they keep kombu's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from claw_tasks.worker.guard import dead_letter_raw


class Channel(kombu_redis.Channel):
    _sync_client: redis.Redis | None = None

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        if client:
            yield client
            return
        pool = self.pool  # a new one after _disconnect_pools (fork, close, reconnect)
        cached = self._sync_client
        if cached is None or cached.connection_pool is not pool:
            cached = self._sync_client = self._create_client()
        yield cached

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:  # the kombu Connection was closed under us
            raise redis.ConnectionError(
                "broker connection closed; its unacked messages return after the visibility timeout"
            )
        return super()._connparams(asynchronous=asynchronous)

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        ret = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

        def guarded(raw: Any) -> Any:
            """kombu's delivery callback (``virtual.Channel.basic_consume``), with the
            message built once and a failure to build it dead-lettered."""
            try:
                message = self.Message(raw, channel=self)
            except Exception as e:
                return self._bad_envelope(queue, raw, e)
            if not no_ack:
                self.qos.append(message, message.delivery_tag)
            return callback(message)

        self.connection._callbacks[queue] = guarded
        return ret

    def _bad_envelope(self, queue: str, raw: Any, e: Exception) -> None:
        try:
            data = dumps(raw).encode()
        except Exception:
            data = repr(raw).encode()
        if not dead_letter_raw(data, f"kombu cannot read the envelope: {type(e).__name__}: {e}"):
            self._put(queue, raw)  # Redis could not record it: back to the queue


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT_ALIASES.update(redis=f"{__name__}:Transport", rediss=f"{__name__}:Transport")

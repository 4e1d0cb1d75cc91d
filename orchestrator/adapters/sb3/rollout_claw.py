"""What a :class:`~orchestrator.adapters.sb3.rollout.ClawRolloutBuffer` holds in Claw: its
namespace's Ingestor, its ``rollout`` recipe, the :class:`Writer` thread its calls to
Claw run in, the in-process commit of a rollout's last steps (:class:`CommitHere`), and
their closing (on ``close()``, garbage collection or exit)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from claw_tasks.client import Ingestor
from claw_tasks.format.message import IngestOutcome
from claw_tasks.format.schema import Schema
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.worker import context, ingest
from orchestrator.delivery.client import BatchClient

log = logging.getLogger(__name__)

RUN_TAG = "sb3_buffer"
"""A string tag naming the buffer that wrote a step: its recipe takes only its own steps
(a namespace reused by a later run, or shared, holds others of the same versions)."""


class Writer:
    """Runs a buffer's calls to Claw (``advance``, ``add_batch``) in order in one thread,
    off SB3's collect loop: each is a publish or a transaction whose round trips the loop
    would otherwise wait for. :meth:`wait` returns once every call
    submitted so far is done, raising the first error one of them met (and every later
    :meth:`submit` raises it too)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None]
        self._calls = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="claw-rollout-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args = call
            try:
                if self.error is None:
                    fn(*args)
            except BaseException as e:  # raised by the buffer's next call
                self.error = e
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.error is not None:
            raise self.error
        with self._cond:
            self._pending += 1
        self._calls.put((fn, args))

    def wait(self, timeout: float | None = None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"{self._pending} writes to Claw not done within {timeout} s")
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=60)


class CommitHere:
    """An ``Ingestor.add_batch`` ``deliver``: commits a message in this process with the
    ingest task's own code (:func:`claw_tasks.worker.ingest.run`: the same checks, the
    same idempotent commit, done record and dead letters as a worker's), for a learner
    that waits for the commit next. A transient Redis error leaves the message to be
    published (a worker retries it, as it would its own). ``outcomes``: those of the
    messages committed here since the caller last emptied it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.outcomes: list[IngestOutcome] = []

    def __call__(self, args: list[Any]) -> bool:
        try:
            outcome = ingest.run(
                self.store.r, args, {}, get_settings().limits, lambda _ns: self.store
            )
        except Exception as e:
            if not ingest.is_transient(e):
                raise
            log.warning("committing a rollout's last steps here failed (%s): published", e)
            return False
        self.outcomes.append(outcome)
        return True


def open_ingestor(
    namespace: str,
    redis_url: str | None,
    broker_url: str | None,
    capacity: int | None,
    steps: int,
    schema: Schema,
    ingest: Mapping[str, Any] | None,
) -> Ingestor:
    """The buffer's Ingestor on ``namespace``: a new namespace holds two rollouts of
    ``steps`` unless ``capacity`` says otherwise, an existing one keeps its own, which
    must hold one rollout."""
    if capacity is None:  # a new namespace: two rollouts; an existing one keeps its own
        probe = Store(redis_url or get_settings().redis_url, namespace)
        capacity = None if probe.exists() else 2 * steps
        probe.r.close()
    ingest_kw = {"flush_steps": max(steps, 256), **(ingest or {})}
    ingestor = Ingestor(
        namespace,
        redis_url,
        broker_url=broker_url,
        capacity=capacity,
        schema=schema,
        **ingest_kw,
    )
    held = ingestor.store.config().capacity
    if held < steps:
        ingestor.close()
        raise ValueError(
            f"namespace {namespace!r} holds {held} steps; a rollout is {steps} "
            "(n_steps x n_envs): use another namespace or pass a larger capacity for a new one"
        )
    return ingestor


def rollout_recipe(
    name: str,
    steps: int,
    run: str,
    version: int,
    gamma: float,
    seed: int,
    gae_lambda: float,
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """The buffer's ``rollout`` recipe: its run's steps of the version being served, the
    whole rollout in one message (its first epoch; the others are ordered by the buffer),
    advantages not normalized (PPO normalizes per minibatch itself, A2C not at all)."""
    return {
        "name": name,
        "batch_size": steps,  # the whole rollout in one message: its first epoch
        "fields": ["obs", "action"],
        "sources": [{"name": "rollouts", "where": {f"tags.{RUN_TAG}": run}}],
        "params": {"policy_version": version},
        "gamma": gamma,
        "seed": seed,
        "prefetch": {"depth": 1},
        "rollout": {
            "steps": steps,
            "epochs": 1,  # the others: the same rows, ordered here (see get)
            "gae_lambda": gae_lambda,
            "normalize": False,  # PPO normalizes per minibatch itself, A2C not at all
        },
        **overrides,
    }


def close_rollout(
    writer: Writer, ingestor: Ingestor, client: BatchClient, names: list[str]
) -> None:
    """Stop the writer, close the Ingestor, unregister the recipes, let go of what forming
    rollouts here held (the namespace's sampling index in this process); never raises."""
    writer.close()
    try:
        context.forget(ingestor.namespace, dropped=False)
    except Exception as e:
        log.warning("closing a ClawRolloutBuffer's sampling index: %s: %s", type(e).__name__, e)
    try:
        ingestor.close(timeout=10.0)
    except Exception as e:  # at exit or in GC: never raise
        log.warning("closing a ClawRolloutBuffer's ingestor: %s: %s", type(e).__name__, e)
    finally:
        for name in names:
            try:
                client.unregister(name)
            except Exception as e:
                log.warning("unregistering recipe %r: %s: %s", name, type(e).__name__, e)
        client.close()

"""The gateway's recording side: a queue the request handlers put finished calls on, and
one thread that turns them into steps through the Ingestor. Nothing here runs on the
response path: a handler only appends to the queue (and a full queue drops the record,
counted, rather than delay an agent)."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from claw_tasks.client import Ingestor
from claw_tasks.llm import attach_rewards
from claw_tasks.lru import LRU
from claw_tasks.schema import SchemaError
from orchestrator.gateway.capture import CaptureError, Retokenizer, capture
from orchestrator.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class TrajectoryError(ValueError):
    """A call or reward the trajectory's state does not allow (the message says why)."""


@dataclass
class Call:
    """A successful upstream call, as the handler saw it."""

    trajectory_uid: str
    prompt_uid: str | None
    kind: str
    request: dict[str, Any]
    reply: bytes
    streamed: bool
    tags: dict[str, str]


@dataclass
class _Trajectory:
    calls: int = 0  # accepted by a handler (the turn budget counts these)
    recorded: int = 0  # committed or buffered as steps
    dropped: int = 0  # accepted but not recordable (no log-probs, queue full, ...)
    finished: bool = False


class Recorder:
    """Owns the Ingestor and the per-trajectory state (bounded: an LRU of
    ``max_trajectories``; a trajectory evicted from it starts counting its turns again)."""

    def __init__(
        self,
        ingestor: Ingestor,
        metrics: GatewayMetrics,
        *,
        retokenizer: Retokenizer | None = None,
        max_turns: int = 256,
        queue_size: int = 10_000,
        max_trajectories: int = 100_000,
        policy_version: int | None = None,
    ) -> None:
        self.ingestor = ingestor
        self.metrics = metrics
        self.retokenizer = retokenizer
        self.max_turns = max_turns
        self.policy_version = policy_version
        self._queue: queue.Queue[Call | None] = queue.Queue(queue_size)
        self._trajectories: LRU[str, _Trajectory] = LRU(max_trajectories)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="claw-gateway-recorder")
        self._thread.start()

    # ---- handler side (event loop; must not block) ------------------------------------
    def admit(self, trajectory_uid: str) -> None:
        """Called before forwarding: refuse a finished trajectory or one over budget."""
        with self._lock:
            t = self._trajectories.get(trajectory_uid, _Trajectory)
            if t.finished:
                raise TrajectoryError(
                    f"trajectory {trajectory_uid!r} is finished (its reward was posted); "
                    "start a new trajectory id"
                )
            if t.calls >= self.max_turns:
                raise TrajectoryError(
                    f"trajectory {trajectory_uid!r} reached the limit of {self.max_turns} "
                    "turns (claw gateway --max-turns)"
                )
            t.calls += 1

    def submit(self, call: Call) -> None:
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self._drop(call.trajectory_uid, "queue_full")

    def refund(self, trajectory_uid: str) -> None:
        """A call admitted but not answered upstream: it does not use the turn budget."""
        with self._lock:
            t = self._trajectories.get(trajectory_uid, _Trajectory)
            t.calls = max(0, t.calls - 1)

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    # ---- recorder thread ------------------------------------------------------------
    def _run(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                self._record(call)
            except CaptureError as e:
                log.info("call of trajectory %r not recorded: %s", call.trajectory_uid, e)
                self._drop(call.trajectory_uid, "uncapturable")
            except Exception:
                log.exception("recording a call of trajectory %r failed", call.trajectory_uid)
                self._drop(call.trajectory_uid, "error")
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _record(self, call: Call) -> None:
        turn = capture(call.kind, call.request, call.reply, call.streamed, self.retokenizer)
        with self._lock:
            t = self._trajectories.get(call.trajectory_uid, _Trajectory)
            index = t.recorded
        try:
            self.ingestor.llm_turn(
                call.trajectory_uid, index, turn.prompt_ids, turn.response_ids,
                turn.response_logprobs, prompt_uid=call.prompt_uid,
                policy_version=self.policy_version, messages=turn.messages,
                tool_calls=turn.tool_calls, retokenized=turn.retokenized,
                info={"finish_reason": turn.finish_reason, "model": turn.model},
                **call.tags,
            )  # fmt: skip
        except SchemaError as e:  # refused before buffering: not a step
            raise CaptureError(str(e)) from None
        except Exception:  # buffered, but the send it started failed: kept and re-sent
            log.warning("sending recorded turns failed; they are kept and re-sent", exc_info=True)
        with self._lock:
            t.recorded += 1
        self.metrics.recorded.inc()
        if turn.retokenized:
            self.metrics.retokenized.inc()

    def _drop(self, trajectory_uid: str, reason: str) -> None:
        with self._lock:
            self._trajectories.get(trajectory_uid, _Trajectory).dropped += 1
        self.metrics.unrecorded.labels(reason).inc()

    # ---- rewards (run in a worker thread, off the event loop) ------------------------------
    def reward(
        self,
        trajectory_uid: str,
        final_reward: float,
        turn_rewards: list[float] | None,
        reward_source: str | None,
        timeout: float = 60.0,
    ) -> int:
        """Finish a trajectory: wait until its calls are recorded and committed, then
        attach the rewards (``claw_tasks.llm.attach_rewards``). Returns its turn count."""
        with self._lock:
            t = self._trajectories.get(trajectory_uid, _Trajectory)
            if t.finished:
                raise TrajectoryError(f"trajectory {trajectory_uid!r} already has its reward")
            t.finished = True  # no new calls from here on
        try:
            self._queue.join()  # every call accepted so far is recorded (or dropped)
            self.ingestor.flush(wait=True, timeout=timeout)
            if t.recorded == 0:
                raise TrajectoryError(
                    f"trajectory {trajectory_uid!r} has no recorded turns to reward"
                )
            if turn_rewards is not None and t.dropped:
                raise TrajectoryError(
                    f"trajectory {trajectory_uid!r}: {t.dropped} of its calls could not be "
                    "recorded, so per-turn rewards cannot be matched to turns; post only "
                    "final_reward"
                )
            attach_rewards(
                self.ingestor.store, trajectory_uid, final_reward, turn_rewards,
                reward_source=reward_source, expect_turns=t.recorded,
            )  # fmt: skip
        except Exception:
            with self._lock:
                t.finished = False  # the reward may be posted again
            raise
        self.metrics.rewarded.inc()
        return t.recorded

    def close(self, timeout: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join()
        self.ingestor.close(timeout=timeout)

"""The gateway's recording side: a queue the request handlers put finished calls on, and
one thread that turns them into steps through the Ingestor. Nothing here runs on the
response path: a handler only appends to the queue (and a full queue drops the record,
counted, rather than delay an agent). No reply can stop the thread: whatever a call's
recording raises, the call is counted unrecorded with a reason and the next one is
recorded; ``health()`` says when the thread is dead or stuck (``/healthz``)."""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import SchemaError
from claw_tasks.store.scripts import Lua, execute
from claw_tasks.store.turns import attach_rewards
from claw_tasks.worker.lru import LRU
from orchestrator.delivery import admission
from orchestrator.gateway import credit
from orchestrator.gateway.calls import (
    Call,
    RecorderError,
    TrajectoryError,
    capture_call,
)
from orchestrator.gateway.capture import CaptureError, Retokenizer, Turn
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.rewards import turn_rewards_by_call, wait_committed

log = logging.getLogger(__name__)

TURN = Lua("turn", "orchestrator")
"""The per-trajectory state script (``orchestrator/lua/turn.lua``)."""
_DRAIN = 256  # calls numbered in one round trip at most


def _arg(value: int | None) -> str:
    return "" if value is None else str(value)


def reward_digest(
    final_reward: float,
    turn_rewards: Sequence[float] | None,
    call_rewards: Mapping[str, float] | None,
    reward_source: str | None,
) -> str:
    """What tells a reward posted again (its reply lost) from another reward: the sha256
    of its values, the same in every gateway process."""
    body = [final_reward, turn_rewards, dict(sorted((call_rewards or {}).items())), reward_source]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:32]


@dataclass
class _Trajectory:
    calls: int = 0  # accepted by this process's handlers (the turn budget counts these)
    dropped: int = 0  # accepted but not recordable (no log-probs, queue full, ...)
    finished: str = ""  # the digest of the reward posted ("" none)


class Recorder:
    """Owns the Ingestor and the trajectories' state. Turn indices and the finished mark
    live in Redis (``orchestrator/lua/turn.lua``: a hash per trajectory with a TTL), so
    every gateway process serving a trajectory, and a gateway restarted mid-trajectory,
    number its turns 0, 1, 2, ... without gaps; the recorder thread asks for them, several
    calls in one round trip, never the handlers. The turn budget and the quick refusal of
    a finished trajectory are this process's (an LRU of ``max_trajectories``), so they stay
    off Redis on the response path; a call another process finished is refused when it is
    recorded (``reason="finished"``)."""

    def __init__(
        self,
        ingestor: Ingestor,
        metrics: GatewayMetrics,
        *,
        retokenizer: Retokenizer | None = None,
        max_turns: int = 256,
        queue_size: int = 10_000,
        queue_bytes: int = 256 * 1024 * 1024,
        stall_after: float = 120.0,
        max_trajectories: int = 100_000,
        policy_version: int | None = None,
        trajectory_ttl: int = 7 * 86400,
        admission_expiry: float = 3600.0,
        who: str = "",
    ) -> None:
        self.ingestor = ingestor
        self.store = ingestor.store
        self.metrics = metrics
        self.retokenizer = retokenizer
        self.max_turns = max_turns
        self.policy_version = policy_version
        self.ttl = trajectory_ttl
        self.expiry = admission_expiry  # an open trajectory's expiry, moved by each turn
        self.who = who  # this gateway, in the admission log
        self._queue: queue.Queue[Call | None] = queue.Queue(queue_size)
        self._trajectories: LRU[str, _Trajectory] = LRU(max_trajectories)
        self._lock = threading.Lock()
        # Progress, for rewards and /healthz: calls queued and calls done (recorded or
        # dropped) so far, the replies' bytes waiting, and since when the thread has been on
        # its current batch (None: waiting for one).
        self._progress = threading.Condition(self._lock)
        self._queued = self._done = 0
        self._queued_bytes, self.queue_bytes = 0, queue_bytes
        self._busy_since: float | None = None
        self.stall_after = stall_after
        self.store.r.script_load(TURN.source)
        self._thread = threading.Thread(target=self._run, name="claw-gateway-recorder")
        self._thread.start()

    def _key(self, trajectory_uid: str) -> str:
        return admission.trajectory_key(self.store, trajectory_uid)

    # ---- handler side (event loop; must not block) ------------------------------------
    def admit(self, trajectories: Sequence[str]) -> None:
        """Called before forwarding: refuse a finished trajectory or one over budget (all
        of a call's trajectories, or none)."""
        with self._lock:
            found = [self._trajectories.get(u, _Trajectory) for u in trajectories]
            for uid, t in zip(trajectories, found, strict=True):
                if t.finished:
                    raise TrajectoryError(
                        f"trajectory {uid!r} is finished (its reward was posted); "
                        "start a new trajectory id"
                    )
                if t.calls >= self.max_turns:
                    raise TrajectoryError(
                        f"trajectory {uid!r} reached the limit of {self.max_turns} "
                        "turns (claw gateway --max-turns)"
                    )
            for t in found:
                t.calls += 1

    def submit(self, call: Call) -> None:
        with self._lock:
            if self._queued_bytes + len(call.reply) > self.queue_bytes:
                full = True
            else:
                try:
                    self._queue.put_nowait(call)
                except queue.Full:
                    full = True
                else:
                    full = False
                    self._queued += 1
                    self._queued_bytes += len(call.reply)
        if full:
            self.unrecorded(call.trajectories, "queue_full")

    def refund(self, trajectories: Sequence[str]) -> None:
        """A call admitted but not answered upstream: it does not use the turn budget."""
        with self._lock:
            for uid in trajectories:
                t = self._trajectories.get(uid, _Trajectory)
                t.calls = max(0, t.calls - 1)

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def health(self) -> str | None:
        """None while the thread records; else what is wrong with it (for /healthz)."""
        if not self._thread.is_alive():
            return "the recorder thread is not running: calls are answered but not recorded"
        since = self._busy_since
        if since is not None and time.monotonic() - since > self.stall_after:
            return (
                f"the recorder has been on one batch of calls for over {self.stall_after:g} s "
                "(CLAW_GATEWAY_RECORDER_STALL): is Redis answering?"
            )
        return None

    # ---- recorder thread ------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            calls = [self._queue.get()]
            while len(calls) < _DRAIN:  # what queued up meanwhile, in the same round trip
                try:
                    calls.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if calls[-1] is None:
                stop = True
                calls.pop()
            self._busy_since = time.monotonic()
            try:
                self._record_all(calls)  # type: ignore[arg-type]  # the stop marker (None) was popped above
            except Exception:  # a bug: no call may stop the thread; these count as errors
                log.exception("recording %d calls failed", len(calls))
                for c in calls:
                    self.unrecorded(c.trajectories, "error")  # type: ignore[union-attr]  # the stop marker (None) was popped above
            finally:
                self._busy_since = None
                with self._progress:
                    self._done += len(calls)
                    self._queued_bytes -= sum(len(c.reply) for c in calls)  # type: ignore[union-attr]  # the stop marker (None) was popped above
                    self._progress.notify_all()

    def _record_all(self, calls: list[Call]) -> None:
        captured: list[list[Turn] | None] = []
        for call in calls:
            try:
                captured.append(capture_call(call, self.retokenizer, self.policy_version))
            except CaptureError as e:
                log.info("call of trajectory %r not recorded: %s", call.trajectory_uid, e)
                self.unrecorded(call.trajectories, "uncapturable")
                captured.append(None)
            except Exception as e:  # a 200 reply that is not the OpenAI shape
                log.info(
                    "call of trajectory %r not recorded: malformed reply (%s: %s)",
                    call.trajectory_uid,
                    type(e).__name__,
                    e,
                )
                self.unrecorded(call.trajectories, "malformed")
                captured.append(None)
        todo = [
            (c, uid, turn)
            for c, turns in zip(calls, captured, strict=True)
            if turns is not None
            for uid, turn in zip(c.trajectories, turns, strict=True)
        ]
        if not todo:
            return
        budget, opened = admission.admission_key(self.store), admission.open_key(self.store)
        try:
            numbered = execute(
                self.store.r,
                [TURN],
                lambda pipe: [
                    TURN.queue(
                        pipe,
                        [self._key(uid), budget, opened],
                        [
                            "turn",
                            self.ttl,
                            _arg(turn.policy_version),
                            c.call_id,
                            self.expiry,
                            uid,
                            c.prompt_uid or "",
                        ],
                    )
                    for c, uid, turn in todo
                ],
            )
        except Exception:
            log.exception("numbering %d recorded turns failed (Redis)", len(todo))
            for _, uid, _ in todo:
                self.unrecorded([uid], "error")
            return
        for (call, uid, turn), (index, version) in zip(todo, numbered, strict=True):
            if int(index) < 0:
                self.unrecorded([uid], "finished")
                continue
            turn.policy_version = None if int(version) < 0 else int(version)
            try:
                self._record(call, uid, turn, int(index))
            except CaptureError as e:
                log.info("call of trajectory %r not recorded: %s", uid, e)
                self.unrecorded([uid], "uncapturable")
            except Exception:
                log.exception("recording a call of trajectory %r failed", uid)
                self.unrecorded([uid], "error")

    def _record(self, call: Call, trajectory_uid: str, turn: Turn, index: int) -> None:
        info: dict[str, Any] = {"finish_reason": turn.finish_reason, "model": turn.model}
        if call.call_id:
            info["call_id"] = call.call_id
        group = call.prompt_uid
        if group is None and len(call.trajectories) > 1:
            group = call.trajectory_uid  # n samples of one prompt: one group
        try:
            self.ingestor.llm_turn(
                trajectory_uid,
                index,
                turn.prompt_ids,
                turn.response_ids,
                turn.response_logprobs,
                prompt_uid=group,
                policy_version=turn.policy_version,
                messages=turn.messages,
                tool_calls=turn.tool_calls,
                retokenized=turn.retokenized,
                info=info,
                **call.tags,
            )
        except SchemaError as e:  # refused before buffering: not a step (its index is a gap)
            raise CaptureError(str(e)) from None
        except Exception:  # buffered, but the send it started failed: kept and re-sent
            log.warning("sending recorded turns failed; they are kept and re-sent", exc_info=True)
        self.metrics.recorded.inc()
        if turn.retokenized:
            self.metrics.retokenized.inc()

    def unrecorded(self, trajectories: Sequence[str], reason: str) -> None:
        """Count an answered call (or one choice of it) that is not recorded (per-turn
        rewards of its trajectories then refuse)."""
        with self._lock:
            for uid in trajectories:
                self._trajectories.get(uid, _Trajectory).dropped += 1
        self.metrics.unrecorded.labels(reason).inc()

    # ---- rewards (run in a worker thread, off the event loop) ------------------------------
    def reward(
        self,
        trajectory_uid: str,
        final_reward: float,
        turn_rewards: list[float] | None,
        reward_source: str | None,
        timeout: float = 60.0,
        call_rewards: Mapping[str, float] | None = None,
    ) -> int:
        """Finish a trajectory: wait until its calls are recorded and committed (this
        process's, then any other gateway's: the turns handed out in Redis), then attach
        the rewards (``claw_tasks.format.turns.attach_rewards``: ``call_rewards`` by the
        calls' interaction ids become turn rewards; the namespace's turn discount, if set,
        applies; ``tags.min_version``/``max_version`` from its turns' versions). Admission
        learns of the reward first, before the rewards make its steps servable: a
        trajectory too old to be served gives back its slots, a fresh one joins the
        rewarded, unserved ones, so a fill that serves it the moment its steps land takes
        it out of them (done the other way round, it would join them after being served
        and lapse later, releasing slots a trainer consumed). Returns its turn count.

        The same reward posted again (its reply was lost) is taken again: answered at once
        once it is attached, else carried on from where its first post stopped (the
        gateway that took it died midway): every step after the mark is idempotent. Only
        another reward is refused."""
        digest = reward_digest(final_reward, turn_rewards, call_rewards, reward_source)
        with self._lock:
            t = self._trajectories.get(trajectory_uid, _Trajectory)
            if t.finished and t.finished != digest:
                raise TrajectoryError(f"trajectory {trajectory_uid!r} already has its reward")
            t.finished = digest  # no new calls from here on
        key = self._key(trajectory_uid)
        finished, status = False, -1
        try:
            self._wait_recorded(timeout)  # every call accepted so far is numbered (or dropped)
            both = [key, admission.admission_key(self.store)]
            got = TURN(self.store.r, both, ["finish", self.ttl, digest])
            status = int(got[0])
            if status < 0:
                raise TrajectoryError(f"trajectory {trajectory_uid!r} already has its reward")
            finished = status == 1  # a failure below reopens only what this post closed
            turns, vmin, vmax = int(got[1]), int(got[2]), int(got[3])
            if status == 2:  # attached already: the same answer as the first time
                return turns
            group = got[4].decode() if isinstance(got[4], bytes) else str(got[4])
            if turns == 0:
                raise TrajectoryError(
                    f"trajectory {trajectory_uid!r} has no recorded turns to reward"
                )
            if (turn_rewards is not None or call_rewards) and t.dropped:
                raise TrajectoryError(
                    f"trajectory {trajectory_uid!r}: {t.dropped} of its calls could not be "
                    "recorded, so per-turn rewards cannot be matched to turns; post only "
                    "final_reward"
                )
            if call_rewards:
                turn_rewards = turn_rewards_by_call(
                    self.store, trajectory_uid, key, turns, call_rewards
                )
            self.ingestor.flush(wait=True, timeout=timeout)
            wait_committed(self.store, trajectory_uid, turns, time.monotonic() + timeout)
            self._finish_admission(trajectory_uid, group, vmin)
            tags = {} if vmin < 0 else {"min_version": float(vmin), "max_version": float(vmax)}
            attach_rewards(
                self.store,
                trajectory_uid,
                final_reward,
                turn_rewards,
                reward_source=reward_source,
                expect_turns=turns,
                discount=credit.discount(self.store),
                tags=tags,
            )
            if int(TURN(self.store.r, both, ["attached", self.ttl, digest])) < 0:
                raise TrajectoryError(f"trajectory {trajectory_uid!r} already has its reward")
        except Exception:
            if status != 0:  # else another post of it holds the mark: it stays here too
                with self._lock:
                    t.finished = ""  # the reward may be posted again
            if finished:
                TURN(self.store.r, both, ["reopen", self.ttl, digest])
            raise
        self.metrics.rewarded.inc()
        return turns

    def _finish_admission(self, trajectory_uid: str, group: str, vmin: int) -> None:
        """The trajectory's end, told to admission (a failure is logged: the reward goes
        on, the slots stay counted)."""
        try:
            released = admission.release_stale(
                self.store, trajectory_uid, group, None if vmin < 0 else vmin, self.who
            )
        except Exception:
            log.warning("admission: finishing %r failed", trajectory_uid, exc_info=True)
            return
        if released:
            self.metrics.released.inc(released)

    def _wait_recorded(self, timeout: float) -> None:
        """Until the calls queued so far are done; a RecorderError if the thread is dead
        or does not get there within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._progress:
            target = self._queued
            while self._done < target:
                problem = self.health()
                left = deadline - time.monotonic()
                if problem is not None or left <= 0:
                    raise RecorderError(
                        problem
                        or f"the recorder did not record this trajectory's calls "
                        f"within {timeout:g} s; post the reward again"
                    )
                self._progress.wait(min(left, 1.0))

    def close(self, timeout: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join()
        self.ingestor.close(timeout=timeout)

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
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from claw_tasks.client import Ingestor
from claw_tasks.client.checks import Step
from claw_tasks.format.schema import SchemaError
from claw_tasks.store.batches import done_key
from claw_tasks.store.scripts import Lua, execute
from claw_tasks.store.turns import attach_rewards
from claw_tasks.worker.ingest import is_transient
from claw_tasks.worker.lru import LRU
from orchestrator.delivery import admission
from orchestrator.gateway import credit
from orchestrator.gateway.calls import (
    Call,
    RecorderError,
    TrajectoryError,
    call_of_record,
    call_record,
    capture_call,
)
from orchestrator.gateway.capture import CaptureError, Retokenizer, Turn
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.rewards import turn_rewards_by_call, wait_committed
from orchestrator.gateway.spool import Spool, Spooled

log = logging.getLogger(__name__)

TURN = Lua("turn", "orchestrator")
"""The per-trajectory state script (``orchestrator/lua/turn.lua``)."""
_DRAIN = 256  # calls numbered in one round trip (and sent in one batch) at most
RETRY_S, RETRY_MAX_S = 0.5, 5.0
"""The first and the longest wait before the store is asked again to number turns it
could not (unreachable)."""
CONFIRM_S = 0.5
"""How often the recorder asks the store which of its batches are committed (one MGET),
to settle their calls in the spool."""


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
class _Replay:
    """Calls a previous process on the spool grouped under ``batch_id`` before it died:
    recorded again as that one batch (the ingest worker commits a batch id once)."""

    batch_id: str
    calls: list[Call] = field(default_factory=list)


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
        spool: Spool | None = None,
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
        self.spool = spool
        # batch id -> its calls and the ids of the messages it went in, until committed
        self._sent: dict[str, tuple[list[str], list[str]]] = {}
        self._closing = threading.Event()
        self._queue: queue.Queue[Call | _Replay | None] = queue.Queue(queue_size)
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

    def keep(self, call: Call) -> None:
        """Spool the answered call (before its reply goes back); one counted as
        ``claw_gateway_spool_dropped_calls`` when the spool is full or unwritable (it is
        recorded all the same, from memory)."""
        if self.spool is None:
            return
        try:
            kept = self.spool.append_call(call.call_id, call_record(call), call.reply)
        except (OSError, TypeError) as e:
            log.warning("spooling a call failed: %s", e)
            kept = False
        if not kept:
            self.metrics.spool_dropped.inc()

    def replay(self, found: Sequence[Spooled]) -> None:
        """Queue the calls a previous process left unsettled in the spool (at start,
        before the app serves: a reward waits for them), a grouped call in its batch."""
        batches: dict[str, _Replay] = {}
        items: list[Call | _Replay] = []
        for s in found:
            try:
                call = call_of_record(s.meta, s.body)
            except (ValueError, KeyError, TypeError) as e:  # whole, yet not a call of ours
                log.warning("a spooled call that cannot be read dropped: %r", e)
                self.unrecorded([], "malformed")
                if self.spool is not None:
                    self.spool.settle([s.call_id])
                continue
            if not s.batch_id:
                items.append(call)
            elif s.batch_id in batches:
                batches[s.batch_id].calls.append(call)
            else:
                batches[s.batch_id] = _Replay(s.batch_id, [call])
                items.append(batches[s.batch_id])
        for item in items:
            n = len(item.calls) if isinstance(item, _Replay) else 1
            with self._lock:
                self._queued += n
            self._queue.put(item)  # blocks while full: the thread is draining it
        self.metrics.replayed.inc(len(found))
        if found:
            log.warning("re-recording %d answered calls found in the spool", len(found))

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
            self._settle([call])

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
        stop, checked = False, time.monotonic()
        carry: list[Call | _Replay | None] = []  # taken from the queue, for the next round
        while not stop:
            if time.monotonic() - checked >= CONFIRM_S:
                checked = time.monotonic()
                self._confirm()
            try:
                first = carry.pop() if carry else self._queue.get(timeout=CONFIRM_S)
            except queue.Empty:
                continue
            replay = None
            calls: list[Call] = []
            if isinstance(first, _Replay):
                replay, calls = first, first.calls
            elif first is None:
                stop = True
            else:
                # Numbered at once with what queued up meanwhile (one round trip, one
                # batch): a turn numbered later than it was answered could miss a reward
                # posted to another gateway right after the answer.
                calls.append(first)
                while len(calls) < _DRAIN:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(item, Call):  # the stop marker, or a replayed batch
                        carry.append(item)
                        break
                    calls.append(item)
            self._busy_since = time.monotonic()
            try:
                if calls:
                    self._record_all(calls, replay.batch_id if replay else None)
            except Exception:  # a bug: no call may stop the thread; these count as errors
                log.exception("recording %d calls failed", len(calls))
                for c in calls:
                    self.unrecorded(c.trajectories, "error")
                self._settle(calls)
            finally:
                self._busy_since = None
                with self._progress:
                    self._done += len(calls)
                    if replay is None:
                        self._queued_bytes -= sum(len(c.reply) for c in calls)
                    self._progress.notify_all()

    def _confirm(self) -> None:
        """Settle in the spool the calls of the batches the store committed (the done
        records of all the messages each went in; one MGET). A failure is retried on the
        next round."""
        if not self._sent:
            return
        batches = list(self._sent.items())
        ns = self.store.namespace
        keys = [done_key(ns, m) for _, (_, messages) in batches for m in messages]
        try:
            done = iter(self.store.r.mget(keys))
        except Exception as e:
            log.warning("asking the store which batches are committed failed: %s", e)
            return
        for batch_id, (calls, messages) in batches:
            if all([next(done) is not None for _ in messages]) and self.spool is not None:
                self.spool.settle(calls)
                del self._sent[batch_id]

    def _settle(self, calls: Sequence[Call]) -> None:
        if self.spool is not None:
            self.spool.settle(c.call_id for c in calls)

    def _record_all(self, calls: list[Call], batch_id: str | None = None) -> None:
        """Number the calls' turns (one round trip) and send them as one batch:
        ``batch_id`` the one a previous process grouped them under, else a new one, noted
        in the spool before it is published. A call none of whose turns is sent is
        settled at once; the others once the store confirms the batch. Calls the store
        could not number before the recorder closed stay unsettled, for the next process."""
        steps: list[Step] = []
        sent: dict[str, Call] = {}
        numbered = True
        try:
            numbered = self._number_all(calls, steps, sent)
            if steps:
                batch_id = batch_id or f"gw-{uuid.uuid4().hex}"
                if self.spool is not None:
                    self.spool.group(batch_id, sent)
                messages = self.ingestor.send_steps(steps, batch_id)  # kept if it fails
                if self.spool is not None:
                    self._sent[batch_id] = (list(sent), messages)
        finally:
            if numbered:
                self._settle([c for c in calls if c.call_id not in sent])

    def _number_all(self, calls: list[Call], steps: list[Step], sent: dict[str, Call]) -> bool:
        """The calls' steps, numbered, into ``steps`` (their calls into ``sent``); False if
        the recorder closed while the store could not number them."""
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
            return True
        try:
            numbered = self._number(todo)
        except Exception:
            log.exception("numbering %d recorded turns failed (Redis)", len(todo))
            numbered = []
        if not numbered:
            for _, uid, _ in todo:
                self.unrecorded([uid], "error")
            return numbered is not None
        for (call, uid, turn), (index, version) in zip(todo, numbered, strict=True):
            if int(index) < 0:
                self.unrecorded([uid], "finished")
                continue
            turn.policy_version = None if int(version) < 0 else int(version)
            try:
                steps.append(self._step(call, uid, turn, int(index)))
                sent[call.call_id] = call
            except CaptureError as e:
                log.info("call of trajectory %r not recorded: %s", uid, e)
                self.unrecorded([uid], "uncapturable")
            except Exception:
                log.exception("recording a call of trajectory %r failed", uid)
                self.unrecorded([uid], "error")

    def _number(self, todo: list[tuple[Call, str, Turn]]) -> list[Any] | None:
        """The turns' ``{index, version}`` (one round trip), asked again while the store is
        unreachable (a failover, a partition: the turn script hands a call id its index
        once, so a try whose reply was lost costs nothing) until it answers or the recorder
        closes (None). Another error is raised."""
        budget, opened = admission.admission_key(self.store), admission.open_key(self.store)
        wait = RETRY_S
        while True:
            try:
                return execute(
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
            except Exception as e:
                if not is_transient(e):
                    raise
                if self._closing.is_set():
                    log.warning("numbering %d recorded turns failed at close: %s", len(todo), e)
                    return None
                log.warning(
                    "numbering %d recorded turns failed (%s); asked again in %g s",
                    len(todo),
                    e,
                    wait,
                )
            self._closing.wait(wait)
            wait = min(2 * wait, RETRY_MAX_S)

    def _step(self, call: Call, trajectory_uid: str, turn: Turn, index: int) -> Step:
        info: dict[str, Any] = {"finish_reason": turn.finish_reason, "model": turn.model}
        if call.call_id:
            info["call_id"] = call.call_id
        group = call.prompt_uid
        if group is None and len(call.trajectories) > 1:
            group = call.trajectory_uid  # n samples of one prompt: one group
        try:
            step = self.ingestor.llm_step(
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
        except SchemaError as e:  # refused: not a step (its index is a gap)
            raise CaptureError(str(e)) from None
        self.metrics.recorded.inc()
        if turn.retokenized:
            self.metrics.retokenized.inc()
        return step

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
        """Record what is queued, flush the Ingestor (waiting up to ``timeout`` for the
        store), settle what it committed and release the spool (what is still unsettled
        stays in it for the next process)."""
        self._closing.set()
        self._queue.put(None)
        self._thread.join()
        try:
            self.ingestor.close(timeout=timeout)
        finally:
            self._confirm()
            if self.spool is not None:
                self.spool.close()

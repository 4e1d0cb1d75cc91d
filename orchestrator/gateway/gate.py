"""What a call must pass before it is forwarded, on the event loop: its session key (a key
scoped to one trajectory, ``POST /sessions``) and the staleness budget a new trajectory is
admitted against (``orchestrator/lua/admission.lua``; the trainer declares it,
:mod:`orchestrator.delivery.admission`). Both are one script call, made only for what this
process has not seen yet: a trajectory it admitted and a key it checked in the last
``KEY_RECHECK_S`` seconds pass without a round trip, so the calls after a trajectory's
first cost nothing here, and while no trainer declares a budget (the script said so in the
last ``NO_BUDGET_S``, and no declaration was announced since) neither does a shared-token
call's first. A new trajectory over the budget waits up to ``wait`` seconds,
looking again whenever the script announces a larger budget (a pub/sub channel: the
trainer declared a new version, slots were given back) and at least every
``_POLL_S[1]``; then it is refused: the app answers 429 with ``Retry-After``. A trajectory
admitted and then neither called again nor rewarded for ``expiry`` seconds gives its slots
back: every gateway sweeps the namespace's open trajectories every ``sweep_s`` (and at
once when a call finds the budget full), off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

from redis.exceptions import NoScriptError

from claw_tasks.connection import resp
from claw_tasks.connection.client import async_redis_client
from claw_tasks.store import Store
from claw_tasks.store.scripts import Lua
from claw_tasks.worker.lru import LRU
from orchestrator.delivery import admission
from orchestrator.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

SESSION_PREFIX = "cs~"
"""Session keys read ``cs~<trajectory>~<secret>``: the trajectory they are scoped to is in
the key, so a check reads that trajectory's hash and nothing else."""
KEY_RECHECK_S = 60.0
"""How long this process trusts a session key it checked (a key outlives its trajectory's
state by at most this)."""
STORE_TIMEOUT_S = 2.0
"""A check the store does not answer within this fails (the app decides what follows)."""
_POLL_S = (0.05, 1.0)  # waiting for the budget: first and longest pause between looks
NO_BUDGET_S = 1.0
"""How long a process trusts that no trainer declares a budget: meanwhile a shared-token
call of a new trajectory makes no round trip. A declaration's announcement (the wake
channel) ends it at once; this bounds the miss of one."""
SWEEP_S = 10.0
"""How often a gateway looks for expired trajectories (at most; at least 4 times per
``expiry``). A call that finds the budget full looks at once, at most once a second."""


def key_hash(key: str) -> str:
    """What is stored of a session key (its sha256: the key itself is never kept)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who calls: the shared agent token (``session`` None: any trajectory), or a session
    key, scoped to trajectory ``session`` and the choices ``session~i`` of its own n > 1
    calls (which ones the gate checks: :attr:`SessionInfo.choices`)."""

    session: str | None = None
    keyhash: str = ""

    def allows(self, trajectory_uid: str) -> bool:
        """Whether the id may be this key's at all: its trajectory, or a choice of it."""
        s = self.session
        return s is None or trajectory_uid == s or self.choice(trajectory_uid) is not None

    def choice(self, trajectory_uid: str) -> int | None:
        """i when ``trajectory_uid`` is ``session~i`` (i as a split writes it), else None."""
        head, sep, tail = trajectory_uid.rpartition("~")
        if not sep or head != self.session or not (tail.isascii() and tail.isdigit()):
            return None  # isdigit alone takes '²', which int() refuses
        return int(tail) if tail == str(int(tail)) else None

    def choices_needed(self, trajectories: tuple[str, ...]) -> int:
        """How many choices of the session a call of ``trajectories`` needs granted (the
        highest choice index + 1; 0 when it names only the session's own trajectory)."""
        return max((i + 1 for t in trajectories if (i := self.choice(t)) is not None), default=0)


@dataclass(frozen=True)
class SessionInfo:
    """A session as its trajectory's hash says: its group, whether the key may post the
    reward, how many choices its n > 1 calls made (``S~0 .. S~(choices-1)`` are its), and
    whether the trajectory's reward was posted (``ended``: the key opens nothing more)."""

    group: str | None
    may_reward: bool
    choices: int = 0
    ended: bool = False


@dataclass(frozen=True)
class Verdict:
    """``status``: ``ok``, ``refused`` (over budget after waiting), ``bad_key``,
    ``bad_group``, ``ended`` (the session's trajectory was rewarded) or ``not_choice`` (a
    choice no n > 1 call of the session made); ``session`` the key's session (when one
    was checked)."""

    status: str
    session: SessionInfo | None = None
    waited: bool = False
    budget: int = -1


class Gate:
    """The admission and session checks of one gateway process."""

    def __init__(
        self,
        store: Store,
        redis_url: str,
        metrics: GatewayMetrics,
        *,
        enabled: bool = True,
        wait: float = 10.0,
        ttl: int = 7 * 86400,
        expiry: float = 3600.0,
        sweep_s: float | None = None,
        store_timeout: float = STORE_TIMEOUT_S,
        max_entries: int = 100_000,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.enabled = enabled
        self.wait = wait
        self.ttl = ttl
        self.expiry = expiry
        if sweep_s is None:
            sweep_s = min(SWEEP_S, expiry / 4)
        self.sweep_s = sweep_s if expiry > 0 else 0.0
        self.who = f"{socket.gethostname()}:{os.getpid()}"
        # Bounded: a store that does not answer must not hold calls (the app decides what
        # a call does then).
        self.r = async_redis_client(
            redis_url, socket_timeout=store_timeout, socket_connect_timeout=store_timeout
        )
        self.fast = resp.connect(redis_url, store_timeout)  # the response path's, if it can
        self._admitted: LRU[str, bool] = LRU(max_entries)
        # a session's trajectory -> (its key's hash, when checked, what the check said)
        self._keys: LRU[str, tuple[str, float, SessionInfo]] = LRU(max_entries)
        self._fixed = [admission.admission_key(store), admission.log_key(store)]
        self._open = admission.open_key(store)
        self._url = redis_url
        self._wake: asyncio.Event | None = None  # set (and replaced) when the budget grows
        self._listener: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._swept = 0.0  # when the last sweep began (monotonic)
        self._undeclared = 0.0  # until when no budget is known to be declared (monotonic)
        self._listening = False  # subscribed to the announcements (so trust can end)

    async def aclose(self) -> None:
        for task in (self._listener, self._sweeper):
            if task is not None:
                task.cancel()
        if self.fast is not None:
            await self.fast.aclose()
        await self.r.aclose()

    @property
    def no_budget_known(self) -> bool:
        """Whether a shared-token first call passes now without a round trip (no budget
        declared when last asked, within ``NO_BUDGET_S``, and announcements listened to)."""
        return self._listening and time.monotonic() < self._undeclared

    def _wakeup(self) -> asyncio.Event:
        """The event the next budget announcement sets (listening starts with the first
        call that waits)."""
        if self._listener is None:
            self._wake = asyncio.Event()
            self._listener = asyncio.create_task(self._listen())
        assert self._wake is not None
        return self._wake

    async def _listen(self) -> None:
        channel = admission.admission_key(self.store) + ":wake"
        while True:
            sub = async_redis_client(self._url)  # no read timeout: it waits for messages
            try:
                async with sub.pubsub() as ps:
                    await ps.subscribe(channel)
                    async for message in ps.listen():
                        if message.get("type") == "subscribe":
                            self._listening = True  # announcements reach us from here on
                        if message.get("type") == "message":
                            self._undeclared = 0.0  # a declaration, or slots back: ask
                            wake, self._wake = self._wake, asyncio.Event()
                            if wake is not None:
                                wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # the store went away: waiters poll; listen again soon
                self._listening = False
                await asyncio.sleep(1.0)
            finally:
                self._listening = False
                await sub.aclose()

    async def script(self, lua: Lua, keys: list[str], args: list[Any]) -> Any:
        """Run a script by its sha on the event loop's client (loaded on NOSCRIPT)."""
        if self.fast is not None:
            try:
                return await self.fast.call("EVALSHA", lua.sha, len(keys), *keys, *args)
            except resp.RespError as e:
                if not str(e).startswith("NOSCRIPT"):
                    raise
                await self.fast.call("SCRIPT", "LOAD", lua.source)
                return await self.fast.call("EVALSHA", lua.sha, len(keys), *keys, *args)
        try:
            return await self.r.evalsha(lua.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.r.script_load(lua.source)
            return await self.r.evalsha(lua.sha, len(keys), *keys, *args)

    async def budget(self) -> dict[str, Any] | None:
        """The namespace's declared budget and counters (:func:`admission.state
        <orchestrator.delivery.admission.state>`'s figures), read on the event loop's
        bounded client: a store that does not answer fails this within the store timeout."""
        async with self.r.pipeline(transaction=False) as p:
            p.hgetall(self._fixed[0])
            p.zcard(self._open)
            raw, n_open = await p.execute()
        return admission.state_of(raw, n_open)

    async def sweep(self) -> int:
        """Expire the namespace's trajectories past their expiry and release the rewarded
        ones the version moved past unserved; returns how many did (in a thread: the
        store's sync client)."""
        self._swept = time.monotonic()
        n, lapsed, released = await asyncio.to_thread(self._expire_due)
        if n:
            self.metrics.expired.inc(n)
        if released:
            self.metrics.released.inc(released)
        return n + lapsed

    def _expire_due(self) -> tuple[int, int, int]:
        """Trajectories expired, and trajectories and slots lapsed (rewarded ones the
        version moved past unserved)."""
        n, _ = admission.expire(self.store, admission.due(self.store, time.time()), self.who)
        return n, *admission.lapse(self.store, self.who)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the store went away: the next sweep tries again
                log.warning("admission: expiring open trajectories failed: %s", e)

    def _known_key(self, principal: Principal) -> SessionInfo | None:
        assert principal.session is not None
        got = self._keys.find(principal.session)
        if got is None or got[0] != principal.keyhash or time.monotonic() - got[1] > KEY_RECHECK_S:
            return None
        return got[2]

    def ended(self, trajectory_uid: str) -> None:
        """The reward of ``trajectory_uid`` was posted here: a key of its session that this
        process trusts opens nothing more from now on (other processes learn it when they
        check the key again, within ``KEY_RECHECK_S``)."""
        got = self._keys.find(trajectory_uid)
        if got is not None:
            self._keys.put(trajectory_uid, (got[0], got[1], replace(got[2], ended=True)))

    async def session(self, principal: Principal, choices: int = 0) -> SessionInfo | None:
        """The session of a key (checked at most every ``KEY_RECHECK_S``, and again when
        the check this process trusts does not grant ``choices`` choices), None if the key
        is not valid (wrong, or its trajectory's state expired)."""
        assert principal.session is not None
        known = self._known_key(principal)
        if known is not None and known.choices >= choices:
            return known
        verdict = await self._run(principal, "", (), first=True, last=False)
        return verdict.session if verdict.status in ("ok", "ended") else None

    async def enter(
        self,
        principal: Principal,
        trajectories: tuple[str, ...],
        group: str | None,
        split: int = 0,
    ) -> Verdict:
        """Pass a call of ``trajectories`` in ``group``: check its key, admit what is new.
        ``split``: n when the call is an n > 1 call of the session's trajectory (it makes
        choices ``0 .. n-1`` the key's)."""
        session = principal.session is not None
        known = self._known_key(principal) if session else None
        if known is not None and (
            known.ended or known.choices < max(split, principal.choices_needed(trajectories))
        ):
            known = None  # what the key may do here is the script's to say
        if session and known is not None and group is None:
            group = known.group
        if session and known is not None and group != known.group:
            return Verdict("bad_group", known)
        new = tuple(t for t in trajectories if t not in self._admitted) if self.enabled else ()
        if (not session or known is not None) and not new:
            return Verdict("ok", known)
        if not session and self.no_budget_known:
            for t in new:  # no budget: admitted, not counted (what the script would do)
                self._admitted.put(t, True)
            return Verdict("ok", None)
        if self._sweeper is None and self.enabled and self.sweep_s > 0:
            self._sweeper = asyncio.create_task(self._sweep_forever())
        need = principal.choices_needed(trajectories)
        if session and not new:
            new = trajectories[:0]  # a key check only, with the choices the call needs
        deadline = time.monotonic() + self.wait
        pause, first = _POLL_S[0], True
        while True:
            last = time.monotonic() >= deadline
            verdict = await self._run(
                principal, group or "", new, first=first, last=last, split=split, need=need
            )
            if verdict.status != "refused":
                if verdict.status == "ok" and first is False:
                    verdict = Verdict("ok", verdict.session, True, verdict.budget)
                return verdict
            if first:
                self.metrics.waited.inc()
                if self.sweep_s > 0 and time.monotonic() - self._swept > 1.0:
                    with contextlib.suppress(Exception):  # full: expired slots may be free
                        if await asyncio.wait_for(self.sweep(), STORE_TIMEOUT_S):
                            first = False
                            continue
            if last:
                self.metrics.refused.inc()
                return Verdict("refused", verdict.session, True, verdict.budget)
            first = False
            wake = self._wakeup()
            left = deadline - time.monotonic()
            try:  # jittered: waiters woken together do not all ask at once
                await asyncio.wait_for(wake.wait(), max(0.0, min(pause, left)))
                await asyncio.sleep(0.01 * random.random())
            except TimeoutError:
                pass
            pause = min(pause * 2, _POLL_S[1])

    async def _run(
        self,
        principal: Principal,
        group: str,
        trajectories: tuple[str, ...],
        *,
        first: bool,
        last: bool,
        split: int = 0,
        need: int = 0,
    ) -> Verdict:
        session_uid = principal.session or (trajectories[0] if trajectories else "-")
        keys = [
            *self._fixed,
            admission.reservation_key(self.store, group or session_uid),
            admission.trajectory_key(self.store, session_uid),
            self._open,
            *(admission.trajectory_key(self.store, t) for t in trajectories),
        ]
        args: list[Any] = [
            "enter",
            principal.keyhash,
            group,
            int(first),
            int(last),
            self.who,
            admission.LOG_ENTRIES,
            self.ttl,
            self.expiry,
            split,
            need,
            *trajectories,
        ]
        reply = await self.script(admission.SCRIPT, keys, args)
        status, budget = int(reply[0]), int(reply[1])
        if budget < 0 and self.enabled:  # none declared: trust it for a moment
            self._wakeup()  # listening: a declaration ends the trust at once
            self._undeclared = time.monotonic() + NO_BUDGET_S
        else:
            self._undeclared = 0.0
        info = None
        if principal.session is not None and status != -2:
            sgroup = reply[3].decode() if isinstance(reply[3], bytes) else str(reply[3])
            info = SessionInfo(sgroup or None, bool(int(reply[4])), int(reply[6]), status == -4)
            self._keys.put(principal.session, (principal.keyhash, time.monotonic(), info))
        refusal = {-2: "bad_key", -3: "bad_group", -4: "ended", -5: "not_choice", 0: "refused"}
        if status in refusal:
            return Verdict(refusal[status], None if status == -2 else info, budget=budget)
        for t in trajectories:
            self._admitted.put(t, True)
        if budget >= 0 and int(reply[5]):
            self.metrics.admitted.inc(int(reply[5]))
        return Verdict("ok", info, budget=budget)

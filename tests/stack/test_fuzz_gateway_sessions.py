"""Fuzz the capture gateway's session surface with Hypothesis: session keys (their own,
another session's, forged), the trajectory in the path (the session's, its choices
``S~i`` for any i and spelling, other sessions', arbitrary text with newlines and
non-ASCII, percent-encoded), groups, ``n`` (any integer, or not an integer) and the
route (chat, completions, reward, read), against `claw gateway` and the vLLM-like upstream
over real sockets. A model of each session (the choices its n > 1 calls made, whether it
has turns, whether its reward was posted) says what every answer must be; afterwards no
trajectory the model refused exists in the gateway, nothing refused went upstream, and no
answer was a 5xx or a dropped connection.

CI runs a small fixed-seed storm; ``pytest -m slow`` a larger one (``CLAW_FUZZ_SEED``
picks another seed)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from orchestrator.gateway.requests import TRAJECTORY
from tests.support.gateway import REWARD_TOKEN, start_gateway, start_upstream, train_tokenizer

ADMIN = "admin-fuzz-789"
SEED = int(os.environ.get("CLAW_FUZZ_SEED", "20261207"))
MAX_N = 8
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gw(redis_server, ingest_worker, tmp_path_factory) -> Iterator:
    tmp = tmp_path_factory.mktemp("fuzz-sessions")
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    upstream = start_upstream(tokenizer, tmp / "upstream.log")
    try:
        proc = start_gateway(
            upstream.url,
            f"gw-fz-{uuid.uuid4().hex[:8]}",
            tmp,
            "--max-n",
            str(MAX_N),
            redis_url=redis_server.url,
            env={"CLAW_GATEWAY_ADMIN_TOKEN": ADMIN},
        )
    except Exception:
        upstream.stop()
        raise
    proc.upstream = upstream
    yield proc
    proc.stop()
    upstream.stop()


@dataclass
class Session:
    traj: str
    key: str
    group: str
    granted: int = 0  # choices its n > 1 calls made
    own_turns: int = 0
    ended: bool = False
    rewarded: set[str] = field(default_factory=set)  # its choices with their reward


def _path_traj(s: Session, other: Session, pick: tuple) -> str:
    kind, i, text = pick
    return {
        "own": s.traj,
        "choice": f"{s.traj}~{i}",
        "padded": f"{s.traj}~0{i}",
        "other": other.traj,
        "other_choice": f"{other.traj}~{i}",
        "text": text,
        "own_text": f"{s.traj}{text}",
    }[kind]


TRAJ = st.tuples(
    st.sampled_from(["own", "own", "choice", "choice", "padded", "other", "other_choice", "text"])
    | st.just("own_text"),
    st.integers(0, 12) | st.integers(0, 10**6),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=12)
    | st.sampled_from(["\n", "~", "~7", "%0A", "/x", ".", "..", " ", "~-1", "~1\n"]),
)
N = st.one_of(st.none(), st.integers(-3, MAX_N + 3), st.sampled_from([10**20, 1.5, "2", True]))
OP = st.fixed_dictionaries(
    {
        "route": st.sampled_from(["chat", "chat", "chat", "completions", "reward", "read"]),
        "who": st.sampled_from(["a", "a", "a", "b", "forged"]),
        "traj": TRAJ,
        "group": st.sampled_from([None, None, "own", "other", "zz"]),
        "n": N,
    }
)


def _expect(s: Session, t: str, group_ok: bool, route: str, n) -> set[int]:
    """The statuses the model allows for a key of ``s`` sending ``route`` to ``t``."""
    valid = TRAJECTORY.fullmatch(t) is not None
    if not valid:
        return {400, 404}  # not an id (or not a path at all)
    head, sep, tail = t.rpartition("~")
    choice = int(tail) if sep and head == s.traj else None
    if t != s.traj and choice is None:
        return {403}
    if route == "read":
        return {200} if choice is None or choice < s.granted else {403}
    if route == "reward":
        if choice is not None and choice >= s.granted:
            return {403}
        if s.ended and choice is not None:
            return {409}  # the session's reward ends what its key opens
        if s.ended or (choice is not None and t in s.rewarded):
            return {200}  # the same reward posted again (every post here is final_reward 1)
        if choice is None and s.own_turns == 0:
            return {409}  # nothing recorded to reward
        return {200}
    bad_n = n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N)
    if bad_n:
        return {400}
    k = n or 1
    if choice is not None and k > 1:
        return {400}  # a choice does not split again
    if s.ended or (choice is not None and t in s.rewarded):
        return {409}
    if not group_ok:
        return {403}
    if choice is not None and choice >= s.granted:
        return {403}
    return {200}


def _apply(s: Session, t: str, route: str, n, status: int) -> None:
    if status != 200:
        return
    if route == "reward":
        if t == s.traj:
            s.ended = True
        else:
            s.rewarded.add(t)
    elif route in ("chat", "completions") and t == s.traj:
        if (n or 1) > 1:
            s.granted = max(s.granted, n)
        else:
            s.own_turns += 1


def _storm(gw, n_examples: int) -> dict[str, int]:
    counts = {"requests": 0, "ok": 0, "refused": 0}
    http = httpx.Client(base_url=gw.url, timeout=120)
    up = httpx.Client(base_url=gw.upstream.url, timeout=30)

    def session(group: str) -> Session:
        r = http.post(
            "/sessions", json={"group": group}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert r.status_code == 201, r.text
        body = r.json()
        return Session(body["trajectory_uid"], body["key"], group)

    @seed(SEED)
    @settings(
        max_examples=n_examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(ops=st.lists(OP, min_size=1, max_size=8))
    def storm(ops: list[dict]) -> None:
        a, b = session("ga"), session("gb")
        refused_ids: set[str] = set()
        for op in ops:
            s, other = (a, b) if op["who"] != "b" else (b, a)
            key = s.key if op["who"] != "forged" else f"cs~{s.traj}~{'f' * 43}"
            t = _path_traj(s, other, op["traj"])
            group = {None: None, "own": s.group, "other": other.group, "zz": "zz"}[op["group"]]
            route, n = op["route"], op["n"]
            path = f"/t/{quote(t, safe='')}"
            if route in ("chat", "completions") and group is not None:
                path += f"/g/{quote(group, safe='')}"
            body: dict = {"model": "sim"}
            if route == "chat":
                path, body["messages"] = path + "/v1/chat/completions", ASK
            elif route == "completions":
                path, body["prompt"] = path + "/v1/completions", "What is 2 plus 2?"
            if route in ("chat", "completions") and n is not None:
                body["n"] = n
            before = len(up.get("/_log").json()) if route in ("chat", "completions") else 0
            headers = {"Authorization": f"Bearer {key}"}
            if route == "read":
                r = http.get(path, headers=headers)
            elif route == "reward":
                r = http.post(path + "/reward", json={"final_reward": 1.0}, headers=headers)
            else:
                r = http.post(path, json=body, headers=headers)
            counts["requests"] += 1
            assert r.status_code < 500, (op, t, r.status_code, r.text[:300])
            if op["who"] == "forged":
                want = {400, 401, 403, 404}  # never an answer from the upstream or the store
            else:
                want = _expect(s, t, group in (None, s.group), route, n)
            if t in (".", ".."):
                want = {404}  # a dot segment: the client resolves it out of the path
            assert r.status_code in want, (op, t, group, s, r.status_code, r.text[:300])
            if op["who"] != "forged":
                _apply(s, t, route, n, r.status_code)
            if route in ("chat", "completions"):
                forwarded = len(up.get("/_log").json()) - before
                if r.status_code == 200:
                    counts["ok"] += 1
                    assert forwarded == (n if isinstance(n, int) and n > 1 else 1)
                else:
                    counts["refused"] += 1
                    assert forwarded == 0, (op, t, r.status_code)  # nothing went upstream
                    if TRAJECTORY.fullmatch(t) and t not in (".", ".."):
                        refused_ids.add(t)
        for s in (a, b):  # what the model granted, and nothing else, exists
            made = {s.traj} | {f"{s.traj}~{i}" for i in range(s.granted)}
            refused_ids.difference_update(made)
        for t in refused_ids:
            r = http.get(
                f"/t/{quote(t, safe='')}", headers={"Authorization": f"Bearer {REWARD_TOKEN}"}
            )
            assert r.status_code == 404, (t, r.status_code, r.text[:200])

    try:
        storm()
    finally:
        http.close()
        up.close()
    assert httpx.get(gw.url + "/healthz").json()["status"] == "ok"
    return counts


def test_fuzz_session_routes(gw):
    counts = _storm(gw, 15)
    assert counts["ok"] > 0 and counts["refused"] > 0


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_session_routes_long(gw):
    counts = _storm(gw, 400)
    print(f"session fuzz: {counts}")
    assert counts["ok"] > 0 and counts["refused"] > 0

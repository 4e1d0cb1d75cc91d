"""The capture gateway against hostile traffic and a hostile upstream, over real sockets:
`claw gateway` and the vLLM-like upstream (tests/support/llm_upstream.py, whose hostile models
answer garbage, huge, endless or never) are subprocesses, the agents the `openai` client
or raw httpx, a real ingest worker commits the turns. Every run ends by recording a valid
call: whatever came before, recording continues."""

from __future__ import annotations

import os
import random
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from tests.stack.test_gateway import client
from tests.stack.test_gateway import wait_steps as _wait_steps
from tests.support.gateway import (
    REWARD_TOKEN,
    TOKEN,
    Proc,
    start_gateway,
    start_upstream,
    train_tokenizer,
)
from tests.support.llm_upstream import GARBAGE

AUTH = {"Authorization": f"Bearer {TOKEN}"}
REWARD = {"Authorization": f"Bearer {REWARD_TOKEN}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


HELLO = [{"role": "user", "content": "hello"}]
MiB = 1 << 20


@pytest.fixture(scope="module")
def hostile(redis_server, ingest_worker, tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("gateway-abuse")
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    upstream = start_upstream(tokenizer, tmp / "upstream.log")
    procs = [upstream]

    def gateway(namespace: str, *extra: str, redis_url: str | None = None, **env: str) -> Proc:
        url = redis_url or redis_server.url
        p = start_gateway(upstream.url, namespace, tmp, *extra, redis_url=url, env=env)
        procs.append(p)
        return p

    yield {"gateway": gateway, "redis_url": redis_server.url, "tmp": tmp}
    for p in reversed(procs):
        p.stop()


def rss_mib(proc: Proc) -> tuple[float, float]:
    """(current, peak) resident set of the process, MiB (VmRSS, VmHWM)."""
    status = Path(f"/proc/{proc.proc.pid}/status").read_text()
    got = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M))
    return int(got["VmRSS"]) / 1024, int(got["VmHWM"]) / 1024


def counters(gw: Proc) -> dict[str, float]:
    """The gateway's counters from /metrics, by sample name with labels."""
    text = httpx.get(gw.url + "/metrics", headers=AUTH).text
    return {
        m[0]: float(m[1])
        for m in re.findall(r"^(claw_gateway_\w+_total(?:\{[^}]*\})?) (\S+)$", text, re.M)
    }


def unrecorded(gw: Proc, reason: str) -> float:
    return counters(gw).get(f'claw_gateway_unrecorded_calls_total{{reason="{reason}"}}', 0.0)


def chat(
    gw: Proc, traj: str, model: str, stream: bool = False, http: httpx.Client | None = None, **kw
) -> httpx.Response:
    """A chat call; on ``http``'s connections when given (a client per call reads the CA
    bundle each time: most of a storm's client CPU)."""
    body = {"model": model, "messages": HELLO, "stream": stream}
    return (http or httpx).post(
        f"{gw.url}/t/{traj}/g/q/v1/chat/completions", json=body, headers=AUTH, timeout=60, **kw
    )


def until(get, done, timeout: float = 30):
    """``get()`` again until ``done`` of it holds (a failed assertion after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not done(got := get()):
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    return got


def wait_steps(store: Store, traj: str, n: int) -> dict:
    return _wait_steps(store, traj, n, timeout=30)


def test_a_malformed_reply_does_not_stop_recording(hostile):
    """200 replies that are not the OpenAI shape (``{"choices": "garbage"}`` killed the
    recorder thread): each is answered as it came, counted unrecorded, and the next call
    is recorded, its reward attached; /healthz stays ok."""
    namespace = f"gw-bad-{uuid.uuid4().hex[:8]}"
    gw = hostile["gateway"](namespace)
    store = Store(hostile["redis_url"], namespace)
    for i, want in enumerate(GARBAGE):
        r = chat(gw, "bad", f"garbage:{i}", stream=i % 2 == 1)
        assert r.status_code == 200 and r.content == want, (i, r.text)
    c = client(gw, "good", "q")
    c.chat.completions.create(model="garbage:0", messages=HELLO)  # the openai client too
    resp = c.chat.completions.create(model="sim", messages=HELLO)
    got = wait_steps(store, "good", 1)
    assert got["response_ids"][0].tolist() == resp.choices[0].token_ids
    n = counters(gw)
    bad = sum(v for k, v in n.items() if k.startswith("claw_gateway_unrecorded_calls_total"))
    assert bad == len(GARBAGE) + 1 and unrecorded(gw, "malformed") >= 1
    r = httpx.post(gw.url + "/t/good/reward", json={"final_reward": 1.0}, headers=REWARD)
    assert r.status_code == 200 and r.json()["turns"] == 1, r.text
    r = httpx.post(gw.url + "/t/bad/reward", json={"final_reward": 1.0}, headers=REWARD)
    assert r.status_code == 409 and "no recorded turns" in r.text
    assert httpx.get(gw.url + "/healthz").json()["status"] == "ok"


def test_a_stuck_recorder_fails_healthz_and_rewards_do_not_hang(hostile):
    """The store stops answering (its redis-server SIGSTOPped) while a call is recorded:
    /healthz turns 503 naming the stuck recorder, a reward answers 503 instead of hanging;
    once the store answers again both recover."""
    with RedisServer() as own:
        gw = hostile["gateway"](
            f"gw-stuck-{uuid.uuid4().hex[:8]}",
            redis_url=own.url,
            CLAW_GATEWAY_RECORDER_STALL="1",
        )
        pid = redis.Redis.from_url(own.url).info()["process_id"]
        assert httpx.get(gw.url + "/healthz").status_code == 200
        os.kill(pid, signal.SIGSTOP)
        try:
            assert chat(gw, "s", "sim").status_code == 200  # answered: upstream only
            health = until(lambda: httpx.get(gw.url + "/healthz"), lambda r: r.status_code != 200)
            assert health.status_code == 503 and health.json()["status"] == "failing"
            assert "CLAW_GATEWAY_RECORDER_STALL" in health.json()["problem"]
            r = httpx.post(
                gw.url + "/t/s/reward", json={"final_reward": 1.0}, headers=REWARD, timeout=30
            )
            assert r.status_code == 503 and r.json()["error"]["type"] == "recorder_unavailable"
        finally:
            os.kill(pid, signal.SIGCONT)
        until(lambda: httpx.get(gw.url + "/healthz"), lambda r: r.status_code == 200)
        assert chat(gw, "s2", "sim").status_code == 200


def test_tokens_compare_as_bytes_and_the_upstream_timeout_is_a_setting(hostile):
    """A bearer token with non-ASCII bytes is a 401, not a 500; an upstream that never
    answers is a 502 after CLAW_GATEWAY_UPSTREAM_TIMEOUT (here 1 s, not 600)."""
    gw = hostile["gateway"](f"gw-tok-{uuid.uuid4().hex[:8]}", CLAW_GATEWAY_UPSTREAM_TIMEOUT="1")
    url = f"{gw.url}/t/x/v1/chat/completions"
    for token in (b"Bearer t\xc3\xb6k\xc3\xa9n", b"Bearer \xff\xfe", b"bearer \x80" + b"x" * 40):
        r = httpx.post(
            url, json={"model": "sim", "messages": HELLO}, headers={"authorization": token}
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/metrics", "/t/x/reward"):
        r = httpx.request(
            "GET" if path == "/metrics" else "POST",
            gw.url + path,
            headers={"authorization": b"Bearer \xe2\x82\xac"},
            json={"final_reward": 1},
        )
        assert r.status_code == 401, path
    c = openai.OpenAI(base_url=f"{gw.url}/t/h/v1", api_key=TOKEN, max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError, match="TimeoutError") as e:
        c.chat.completions.create(model="hang", messages=HELLO)
    assert e.value.status_code == 502
    c.chat.completions.create(model="sim", messages=HELLO)  # the next call is answered


def test_huge_replies_pass_through_with_bounded_memory(hostile):
    """A 150 MB reply and a 150 MB stream without [DONE] reach the agent whole while the
    gateway holds at most CLAW_GATEWAY_MAX_REPLY_BYTES of either (here 4 MiB): its peak
    RSS grows by far less than a reply. Both are counted unrecorded (too_large)."""
    namespace = f"gw-huge-{uuid.uuid4().hex[:8]}"
    gw = hostile["gateway"](namespace, CLAW_GATEWAY_MAX_REPLY_BYTES=str(4 * MiB))
    store = Store(hostile["redis_url"], namespace)
    client(gw, "warm", "q").chat.completions.create(model="sim", messages=HELLO)
    _, peak0 = rss_mib(gw)
    size = 150_000_000
    for stream, extra in ((False, len('{"pad": "') + 2), (True, len("data: ") + 2)):
        body = {"model": f"huge:{size}", "messages": HELLO, "stream": stream}
        got = 0
        with httpx.stream(
            "POST", f"{gw.url}/t/h/v1/chat/completions", json=body, headers=AUTH, timeout=120
        ) as r:
            assert r.status_code == 200
            for piece in r.iter_raw():
                got += len(piece)
        assert got == size + extra, stream
    _, peak = rss_mib(gw)
    assert peak - peak0 < 64, (peak0, peak)  # before the bound: +344 MiB and +267 MiB
    assert unrecorded(gw, "too_large") == 2  # both ended: answered calls, not recorded
    resp = client(gw, "after", "q").chat.completions.create(model="sim", messages=HELLO)
    assert wait_steps(store, "after", 1)["response_ids"][0].tolist() == resp.choices[0].token_ids


# ---- fuzz ------------------------------------------------------------------------------
TRICKS = [
    "..",
    "%2e%2e",
    "%2F",
    "a%2Fb",
    "%00",
    "%ff",
    "%0A",
    "a%20b",
    "{x}",
    "%7Bx%7D",
    "x" * 300,
    "%C3%A9",
    "a:b",
    "claw:%7Bns%7D:config",
    "*",
    "%25",
    "-",
    ";",
]
# a tag keeps its kind: n numeric, s a string
TAGS = [
    "n=1",
    "A=1",
    "n",
    "=",
    "n=" + "9" * 300,
    "n=1," * 20,
    "s=\xff",
    "s=1e400",
    ",,,",
    "n=2,s=x",
]
BAD_BODIES = [
    b"",
    b"{",
    b"[]",
    b"null",
    b'"x"',
    b"\xff\xfe\x00",
    b"[" * 5000 + b"]" * 5000,
    b'{"model": "sim", "messages": [], "n": "x"}',
    b'{"model": "sim", "messages": [], "n": [1]}',
    b'{"model": "sim", "messages": [], "n": 1e308}',
    b'{"model": "sim", "messages": [], "n": 1e400}',
    b'{"model": "sim", "messages": [], "n": -99999999999999999999999}',
    b'{"model": "sim", "messages": [], "stream": true, "stream_options": 5}',
    b'{"model": "sim", "messages": [], "stream": true, "stream_options": "ab"}',
    b'{"model": "sim", "messages": [], "stream": true, "stream_options": [[1, 2]]}',
]
BAD_COMPLETIONS = [  # bad only for /v1/completions (a chat sets logprobs itself)
    b'{"model": "sim", "prompt": "hi", "logprobs": 1e308}',
    b'{"model": "sim", "prompt": "hi", "logprobs": "x"}',
]
REWARDS = [
    b'{"final_reward": 1e400}',
    b'{"final_reward": "1"}',
    b'{"final_reward": true}',
    b'{"final_reward": 1, "turn_rewards": "x"}',
    b'{"final_reward": 1, "turn_rewards": [1e308, null]}',
    b'{"final_reward": 1, "reward_source": {"a": 1}}',
    b'{"final_reward": 1, "x": 2}',
    b"[1]",
    b'{"final_reward": 1, "call_rewards": {"0123": 1}}',
    b'{"final_reward": 1, "call_rewards": {"0123456789abcdef": "x"}}',
    b'{"final_reward": 1, "call_rewards": [1]}',
    b'{"final_reward": 1, "call_rewards": {}, "turn_rewards": []}',
]
SESSIONS = [  # bodies of POST /sessions that are not a session
    b"",
    b"[1]",
    b'{"group": 5}',
    b'{"trajectory": "a~1"}',
    b'{"trajectory": "' + b"x" * 300 + b'"}',
    b'{"reward": "no"}',
    b'{"ttl_s": 1e400}',
    b'{"ttl_s": -1}',
    b'{"other": 1}',
    b"{" * 3000,
]
BAD_RESPONSES = [  # bad only for /v1/responses
    b'{"model": "sim", "input": "hi", "include": 5}',
    b'{"model": "sim", "input": "hi", "include": "x"}',
]


def _storm(gw: Proc, rng: random.Random, n: int) -> tuple[list[str], int]:
    """``n`` hostile requests, about one in twelve a valid call on a fresh trajectory.
    Returns the trajectories called validly, how many other calls were valid (path
    tricks that are valid ids) and how many answered replies cannot be recorded."""
    valid, tricks, unrecordable = [], 0, 0
    with httpx.Client(timeout=60) as h:
        for i in range(n):
            op = rng.randrange(12)
            traj = f"f{i}"
            url = f"{gw.url}/t/{traj}/g/q/v1/chat/completions"
            if op == 0:
                r = chat(gw, traj, "sim", stream=rng.random() < 0.5, http=h)
                valid.append(traj)
            elif op == 1:  # oversized: declared, or streamed without a length
                big = b"x" * (70_000 + rng.randrange(200_000))
                if rng.random() < 0.5:
                    r = h.post(url, content=big, headers=AUTH)
                else:
                    r = h.post(url, content=iter([big[:1000], big[1000:]]), headers=AUTH)
                assert r.status_code == 413
            elif op == 2:
                if rng.random() < 0.5:
                    r = h.post(url, content=rng.choice(BAD_BODIES), headers=AUTH)
                else:
                    body = rng.choice(BAD_BODIES + BAD_COMPLETIONS)
                    r = h.post(url.replace("chat/", ""), content=body, headers=AUTH)
                assert r.status_code in (400, 413), r.text
            elif op == 3:  # bad tokens and schemes (any bytes a header value may hold)
                alphabet = [*range(0x21, 0x7F), *range(0x80, 0x100)]
                raw = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
                scheme = rng.choice([b"Bearer ", b"bearer ", b"Basic ", b"", b"Bearer  x"])
                value = (scheme + raw).strip()
                headers = {"authorization": value} if value else {}
                r = h.post(url, json={"model": "sim", "messages": HELLO}, headers=headers)
                assert r.status_code == 401
            elif op == 4:  # path tricks in every path parameter
                t, g = rng.choice(TRICKS), rng.choice([*TRICKS, "q"])
                path = rng.choice(
                    [
                        f"/t/{t}/g/{g}/v1/chat/completions",
                        f"/t/{t}/v1/completions",
                        f"/t/{t}/reward",
                        f"/t/{t}/g/{g}/v1/{t}",
                        f"/{t}",
                    ]
                )
                body = {"model": "sim", "prompt": "hi", "messages": HELLO}
                r = h.post(gw.url + path, json=body, headers=AUTH)
                assert r.status_code in (200, 400, 401, 404, 405), (path, r.text)  # 401: reward
                tricks += r.status_code == 200  # a valid id after all: recorded
            elif op == 5:  # identity and tags in headers
                headers = {
                    **AUTH,
                    "x-claw-trajectory": rng.choice(TRICKS).encode("latin-1", "replace"),
                    "x-claw-tags": rng.choice(TAGS).encode("latin-1", "replace"),
                }
                r = h.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": "sim", "messages": HELLO},
                    headers=headers,
                )
                assert r.status_code in (200, 400), r.text
                if r.status_code == 200:
                    valid.append(headers["x-claw-trajectory"].decode("latin-1"))
            elif op in (6, 7):  # a garbage 200 from the upstream
                k = rng.randrange(len(GARBAGE))
                r = chat(gw, traj, f"garbage:{k}", stream=rng.random() < 0.5, http=h)
                assert r.status_code == 200 and r.content == GARBAGE[k]
                unrecordable += 1
            elif op == 8:  # an endless stream the agent walks away from
                body = {"model": "endless", "messages": HELLO, "stream": True}
                with h.stream("POST", url, json=body, headers=AUTH) as r:
                    assert r.status_code == 200
                    for k, _ in enumerate(r.iter_raw()):
                        if k > rng.randrange(1, 50):
                            break
            elif op == 9:  # a reply over the bound, read whole
                size = rng.randrange(4 * MiB + 1, 6 * MiB)
                r = chat(gw, traj, f"huge:{size}", stream=rng.random() < 0.5, http=h)
                assert r.status_code == 200 and len(r.content) > size
                unrecordable += 1  # too_large (a stream the upstream ended is a call too)
            elif op == 10:
                kind = rng.randrange(4)
                if kind == 0:
                    body = rng.choice(REWARDS)
                    r = h.post(f"{gw.url}/t/{traj}/reward", content=body, headers=REWARD)
                    assert r.status_code in (400, 409), r.text
                elif kind == 1:  # the admin token is the reward token here
                    body = rng.choice(SESSIONS)
                    r = h.post(f"{gw.url}/sessions", content=body, headers=REWARD)
                    assert r.status_code == 400, r.text
                elif kind == 2:  # reads of tricky or missing trajectories
                    t = rng.choice([*TRICKS, traj])
                    r = h.get(f"{gw.url}/t/{t}", headers=REWARD)
                    assert r.status_code in (200, 400, 404), (t, r.text)  # 200: a valid id
                else:  # forged session keys, and bad Responses bodies
                    key = f"cs~{rng.choice(['x', traj, 'a~1'])}~{'k' * rng.randrange(0, 200)}"
                    r = h.post(url, json={"model": "sim", "messages": HELLO}, headers=bearer(key))
                    assert r.status_code in (401, 403), r.text  # 403: another trajectory's
                    r = h.post(
                        f"{gw.url}/t/{traj}/v1/responses",
                        content=rng.choice(BAD_RESPONSES + BAD_BODIES[:7]),
                        headers=AUTH,
                    )
                    assert r.status_code in (400, 413), r.text
            else:  # methods and routes that do not exist
                r = h.request(rng.choice(["GET", "PUT", "DELETE", "PATCH"]), url, headers=AUTH)
                assert r.status_code in (404, 405)
            assert r.status_code < 500, (op, r.status_code, r.text[:300])
    return valid, tricks, unrecordable


def _fuzz(hostile, n: int, seed: int) -> None:
    namespace = f"gw-fuzz-{uuid.uuid4().hex[:8]}"
    gw = hostile["gateway"](
        namespace, "--max-body-bytes", "65536", CLAW_GATEWAY_MAX_REPLY_BYTES=str(4 * MiB)
    )
    store = Store(hostile["redis_url"], namespace)
    client(gw, "warm", "q").chat.completions.create(model="sim", messages=HELLO)
    _, peak0 = rss_mib(gw)
    valid, tricks, unrecordable = _storm(gw, random.Random(seed), n)
    _, peak = rss_mib(gw)
    assert peak - peak0 < 96, (peak0, peak)
    assert httpx.get(gw.url + "/healthz").json()["status"] == "ok"
    resp = client(gw, "after", "q").chat.completions.create(model="sim", messages=HELLO)
    assert wait_steps(store, "after", 1)["response_ids"][0].tolist() == resp.choices[0].token_ids
    for traj in valid:
        assert len(wait_steps(store, traj, 1)["id"]) >= 1, traj
    n_counted = counters(gw)
    assert n_counted["claw_gateway_recorded_turns_total"] == len(valid) + tricks + 2
    lost = sum(v for k, v in n_counted.items() if "unrecorded_calls" in k)
    assert lost == unrecordable


def test_fuzz_gateway(hostile):
    _fuzz(hostile, 200, seed=20261130)


@pytest.mark.slow
def test_fuzz_gateway_long(hostile):
    _fuzz(hostile, 6000, seed=int(os.environ.get("CLAW_FUZZ_SEED", "20261130")))

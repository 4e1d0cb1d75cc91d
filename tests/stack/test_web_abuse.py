"""The web inspector against hostile requests over real sockets (a `claw web` process):
request bodies bounded before anything reads them (tightest without a session), form
fields bounded, 4xx — never 500 — for path parameters that cannot name anything, pages
past the end and ``where`` expressions nested thousands deep; then a fuzz storm over
every route, after which the inspector still logs in, searches and curates."""

from __future__ import annotations

import os
import random
import re
import socket
import threading
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import pytest

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from tests.support.webdata import fill
from tests.support.webserver import WebServer

MiB = 1 << 20


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def ns(redis_server) -> str:
    name = f"abuse-{uuid.uuid4().hex[:8]}"
    fill(redis_server.url, name, episodes=3, length=8)
    return name


@pytest.fixture(scope="module")
def web(redis_server, tmp_path_factory) -> Iterator[WebServer]:
    server = WebServer(redis_server.url, tmp_path_factory.mktemp("web-abuse") / "web.log")
    yield server
    server.stop()


def peak_rss_mib(server: WebServer) -> float:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024


def logged_in(web: WebServer) -> tuple[httpx.Client, str]:
    """A client with a session, and the session's CSRF token."""
    c = httpx.Client(base_url=web.url, timeout=60)
    r = c.post("/login", data={"user": "claw", "password": "pw"})
    assert r.status_code == 303, r.text
    html = c.get("/").text
    return c, re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def raw_request(web: WebServer, head: bytes, body: Iterable[bytes] = ()) -> bytes:
    """Send ``head`` then ``body`` (from a thread, giving up once the server hangs up)
    and return the server's reply as read until it closes the connection."""
    sock = socket.create_connection(("127.0.0.1", web.port), timeout=60)

    def send() -> None:
        try:
            for piece in body:
                sock.sendall(piece)
        except OSError:
            pass  # the server answered and closed: the rest is not wanted

    sock.sendall(head)
    sender = threading.Thread(target=send)
    sender.start()
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
            if b"\r\n\r\n" in reply and b"connection: close" not in reply.lower():
                break
    except ConnectionResetError:
        pass
    sock.close()
    sender.join()
    return reply


def test_login_body_is_bounded_before_authentication(web):
    """An unauthenticated POST /login of 300 fields of 1 MiB (Starlette's defaults take
    1,000 of them: +306 MiB of RSS) is refused with 413 — at once when its length is
    declared, after 4 KiB (CLAW_WEB_LOGIN_BODY_BYTES) when it is chunked — and the
    server's peak RSS barely moves; 17 small fields are refused too."""
    peak0 = peak_rss_mib(web)
    head = b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
    reply = raw_request(web, head + b"Content-Length: %d\r\n\r\n" % (300 * (MiB + 3)))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"CLAW_WEB_LOGIN_BODY_BYTES" in reply

    def fields() -> Iterator[bytes]:
        for k in range(300):
            piece = b"f%d=" % k + b"x" * (MiB - 16) + b"&"  # each within Starlette's 1 MiB
            yield b"%x\r\n%s\r\n" % (len(piece), piece)
        yield b"0\r\n\r\n"

    reply = raw_request(web, head + b"Transfer-Encoding: chunked\r\n\r\n", fields())
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert peak_rss_mib(web) - peak0 < 32, (peak0, peak_rss_mib(web))
    many = {f"f{k}": "x" for k in range(17)} | {"user": "claw", "password": "pw"}
    r = httpx.post(web.url + "/login", data=many)
    assert r.status_code == 400 and "Too many fields" in r.text
    assert (
        httpx.post(web.url + "/login", data={"user": "claw", "password": "pw"}).status_code == 303
    )


def test_bodies_and_fields_are_bounded_after_login(web, ns):
    """Logged in: a body over 1 MiB (CLAW_WEB_MAX_BODY_BYTES) is a 413, more than 1,000
    fields or a file upload a 400; a form within the bounds still curates."""
    c, csrf = logged_in(web)
    r = c.post(f"/ns/{ns}/curate", data={"csrf": csrf, "episode": "x" * (2 * MiB)})
    assert r.status_code == 413 and "CLAW_WEB_MAX_BODY_BYTES" in r.text
    r = c.post(f"/ns/{ns}/curate", data={"csrf": csrf, **{f"id{k}": "1" for k in range(1001)}})
    assert r.status_code == 400 and "Too many fields" in r.text
    r = c.post(f"/ns/{ns}/curate", data={"csrf": csrf}, files={"f": ("a.txt", b"x" * 100)})
    assert r.status_code == 400
    r = c.post(f"/ns/{ns}/curate", data={"csrf": csrf, "episode": "ep0", "quality": "ok"})
    assert r.status_code == 200 and "Labelled 8 steps" in r.text


def test_impossible_paths_and_parameters_are_4xx(web, ns):
    """Namespace names no namespace can have, a page past the end, a step id past int64
    and a where nested 3,000 deep: 4xx with a reason, not a 500."""
    c, _ = logged_in(web)
    for bad in ("a:b", "{x}", "a b", "a\nb"):
        q = urllib.parse.quote(bad, safe="")
        for route in ("search", "episode?e=x", "recipes", "audit", "thumb/1/obs.png"):
            r = c.get(f"/ns/{q}/{route}")
            assert r.status_code == 404 and "no such namespace" in r.text, (bad, route)
    r = c.get(f"/ns/{ns}/episode", params={"e": "ep0", "page": str(10**13)})
    assert r.status_code == 200 and "ep0" in r.text
    r = c.get(f"/ns/{ns}/thumb/{2**70}/obs.png")
    assert r.status_code == 404 and "2**63" in r.text
    for deep in ("(" * 3000 + "reward > 0" + ")" * 3000, "not " * 3000 + "terminated"):
        r = c.get(f"/ns/{ns}/search", params={"where": deep})
        assert r.status_code == 400 and "CLAW_WEB" not in r.text
        assert "CLAW_WHERE_MAX_DEPTH=32" in r.text


# ---- fuzz ------------------------------------------------------------------------------
TRICKS = [
    "a:b",
    "{x}",
    "a b",
    "a\nb",
    "..",
    "%2e%2e",
    "/",
    "\x00",
    "é",
    "x" * 300,
    "",
    "*",
    "claw:{web}:config",
    "'\"<script>",
    "-1",
    str(2**64),
]
NUMBERS = ["-1", "0", "1e400", str(10**13), str(2**70), "9" * 5000, "nan", "", "0x10", " 3"]
WHERES = [
    "(" * 3000 + "reward > 0" + ")" * 3000,
    "not " * 2000 + "terminated",
    "reward >",
    "reward > 1e400",
    "tags.x.y.z == 'a'",
    "reward in [" + ",".join(["1"] * 5000) + "]",
    "age < 99999999999999999999w",
    "task_id == '\\x'",
    "reward > 0 or " * 500 + "terminated",
    "$" * 100,
]


def _storm(web: WebServer, ns: str, rng: random.Random, n: int) -> None:
    c, csrf = logged_in(web)
    anon = httpx.Client(base_url=web.url, timeout=60)
    quote = lambda s: urllib.parse.quote(s, safe="")  # noqa: E731
    for _ in range(n):
        op = rng.randrange(9)
        name = quote(rng.choice([*TRICKS, ns]))
        if op == 0:  # every GET route, tricks in each path parameter
            route = rng.choice(
                [
                    f"/ns/{name}/search",
                    f"/ns/{name}/episode?e={quote(rng.choice(TRICKS))}",
                    f"/ns/{name}/recipes",
                    f"/ns/{name}/audit",
                    f"/ns/{name}/thumb/{rng.choice(NUMBERS)}/{quote(rng.choice(TRICKS))}.png",
                    f"/static/{quote(rng.choice(TRICKS))}",
                    f"/static/..%2f..%2f{quote(rng.choice(TRICKS))}",
                    f"/{name}",
                ]
            )
            r = rng.choice([c, anon]).get(route)
        elif op == 1:  # query parameters
            params = {
                "page": rng.choice(NUMBERS),
                "where": rng.choice(WHERES + TRICKS),
                "since": rng.choice([*NUMBERS, "5m", "1e400s", "99999999999w"]),
                "view": rng.choice(["steps", "episodes", "x"]),
                "e": rng.choice(TRICKS),
                "prefix": rng.choice(TRICKS),
                "next": rng.choice(["//evil", "/\\evil", "http://x", *TRICKS]),
            }
            route = rng.choice([f"/ns/{name}/search", f"/ns/{name}/episode", "/", "/login"])
            r = c.get(route, params=params)
        elif op == 2:  # curation forms with hostile values
            data = {
                "csrf": rng.choice([csrf, csrf, "x", ""]),
                "episode": [rng.choice(TRICKS) for _ in range(rng.randrange(3))],
                "id": [rng.choice(NUMBERS) for _ in range(rng.randrange(3))],
                "trainable": rng.choice(["true", "false", "x", ""]),
                "quality": rng.choice(TRICKS),
                "tag": rng.choice(["", "x", "label", *TRICKS]),
                "tag_value": rng.choice(TRICKS),
            }
            r = c.post(f"/ns/{name}/curate", data=data)
        elif op == 3:  # recipe params
            data = {"csrf": csrf, f"p.{rng.choice(TRICKS)}": rng.choice(WHERES + TRICKS)}
            r = c.post(f"/ns/{name}/recipes/{quote(rng.choice(TRICKS))}", data=data)
        elif op == 4:  # oversized bodies, with and without a session, declared or not
            client, size = rng.choice([(anon, 5000), (c, MiB + 10)])
            body = b"a=" + b"x" * (size + rng.randrange(50_000))
            if rng.random() < 0.5:
                r = client.post("/login", content=body, headers={"content-type": "x"})
            else:
                r = client.post(
                    f"/ns/{ns}/curate",
                    content=iter([body[:100], body[100:]]),  # no length: counted as read
                    headers={"content-type": "application/x-www-form-urlencoded"},
                )
            # 403: a POST without a session is refused before its body is read
            assert r.status_code == 413 or (client is anon and r.status_code == 403)
        elif op == 5:  # malformed bodies and content types
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(2000)))
            ctype = rng.choice(
                [
                    "application/x-www-form-urlencoded",
                    "multipart/form-data; boundary=x",
                    "multipart/form-data",
                    "text/plain",
                    "",
                ]
            )
            target = rng.choice([c, anon])
            r = target.post(
                rng.choice(["/login", f"/ns/{name}/curate", "/logout"]),
                content=body,
                headers={"content-type": ctype},
            )
        elif op == 6:  # too many fields
            k = rng.choice([17, 1001])
            r = rng.choice([c, anon]).post("/login", data={f"f{i}": "x" for i in range(k)})
        elif op == 7:  # cookies
            junk = bytes(b for b in rng.choice(TRICKS).encode("latin-1", "replace") if b > 0x20)
            r = httpx.get(web.url + "/", headers={"cookie": b"claw_session=" + junk}, timeout=60)
        else:  # methods
            r = c.request(rng.choice(["PUT", "DELETE", "PATCH", "OPTIONS"]), f"/ns/{name}/search")
        assert r.status_code < 500, (op, r.request.url, r.status_code, r.text[:300])
    c.close()
    anon.close()


def _fuzz(web: WebServer, ns: str, redis_url: str, n: int, seed: int) -> None:
    peak0 = peak_rss_mib(web)
    _storm(web, ns, random.Random(seed), n)
    assert peak_rss_mib(web) - peak0 < 96, (peak0, peak_rss_mib(web))
    assert web.proc.poll() is None
    c, csrf = logged_in(web)  # still serving: login, search, a write
    assert c.get(f"/ns/{ns}/search", params={"where": "reward > -2"}).status_code == 200
    r = c.post(f"/ns/{ns}/curate", data={"csrf": csrf, "episode": "ep2", "quality": "fuzzed"})
    assert r.status_code == 200
    assert Store(redis_url, ns).episode("ep2", fields=[])["quality"][0] == "fuzzed"


def test_fuzz_web(web, ns, redis_server):
    _fuzz(web, ns, redis_server.url, 400, seed=20261130)


@pytest.mark.slow
def test_fuzz_web_long(web, ns, redis_server):
    _fuzz(web, ns, redis_server.url, 8000, int(os.environ.get("CLAW_FUZZ_SEED", "20261130")))

"""The inspector over plain HTTP against a real `claw web` process: login, sessions, CSRF,
read-only mode, security headers, the printed-once password; and the store's curation
path (free tags, the audit stream, the change log)."""

from __future__ import annotations

import http.cookiejar
import re
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from orchestrator.sampling.index import SamplingIndex
from orchestrator.web.views import Inspector
from tests.support.webdata import fill
from tests.support.webserver import WebServer


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


class Browser:
    """A cookie-keeping HTTP client that does not follow redirects."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(self.jar), NoRedirect
        )

    def request(self, path: str, data: dict | None = None) -> tuple[int, Any, str]:
        body = None if data is None else urllib.parse.urlencode(data, doseq=True).encode()
        try:
            with self.opener.open(self.base + path, data=body, timeout=60) as r:
                return r.status, r.headers, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read().decode()

    def login(self, password: str = "pw") -> str:
        status, headers, _ = self.request("/login", {"user": "claw", "password": password})
        assert status == 303, status
        return headers["Set-Cookie"]

    def csrf(self, path: str = "/") -> str:
        status, _, html = self.request(path)
        assert status == 200
        return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A private server: the inspector's front page lists the namespaces it finds (the
    session server holds every earlier test's)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def ns(redis_server) -> str:
    name = f"web-{uuid.uuid4().hex[:8]}"
    fill(redis_server.url, name, episodes=4, length=10)
    return name


@pytest.fixture(scope="module")
def web(redis_server, tmp_path_factory) -> Iterator[WebServer]:
    server = WebServer(redis_server.url, tmp_path_factory.mktemp("web") / "web.log")
    yield server
    server.stop()


def _trainable(store: Store, episode: str) -> np.ndarray:
    return store.episode(episode, fields=[])["trainable"]


def test_pages_need_a_login(web, ns):
    b = Browser(web.url)
    status, headers, _ = b.request(f"/ns/{ns}/search")
    assert status == 303 and headers["Location"].startswith("/login")
    status, _, html = b.request("/login", {"user": "claw", "password": "wrong"})
    assert status == 401 and "wrong user or password" in html
    cookie = b.login()
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    status, headers, html = b.request(f"/ns/{ns}/search")
    assert status == 200 and "live steps match" in html
    csp = headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_front_page_pages_and_filters_namespaces(web, redis_server):
    prefix = f"pg-{uuid.uuid4().hex[:6]}-"
    for k in range(30):
        fill(redis_server.url, f"{prefix}{k:02d}", episodes=1, length=2, n_shards=1)
    b = Browser(web.url)
    b.login()
    listed = lambda html: re.findall(rf'href="/ns/({re.escape(prefix)}\d+)/search"', html)  # noqa: E731
    status, _, html = b.request("/?" + urllib.parse.urlencode({"prefix": prefix}))
    assert status == 200 and "30 namespaces" in html and "page 1 of 2" in html
    first = listed(html)
    assert first == [f"{prefix}{k:02d}" for k in range(25)]
    _, _, html = b.request("/?" + urllib.parse.urlencode({"prefix": prefix, "page": 1}))
    assert listed(html) == [f"{prefix}{k:02d}" for k in range(25, 30)]
    _, _, html = b.request("/?" + urllib.parse.urlencode({"prefix": prefix, "page": 99}))
    assert listed(html) == [f"{prefix}{k:02d}" for k in range(25, 30)]  # the last page
    _, _, html = b.request("/?" + urllib.parse.urlencode({"prefix": prefix + "x"}))
    assert "No namespace starts with" in html and not listed(html)


def test_writes_need_session_and_csrf(web, ns, redis_server):
    store = Store(redis_server.url, ns)
    form = {"episode": "ep0", "trainable": "false"}
    anonymous = Browser(web.url)
    status, _, _ = anonymous.request(f"/ns/{ns}/curate", {**form, "csrf": "x"})
    assert status == 403
    b = Browser(web.url)
    b.login()
    status, _, html = b.request(f"/ns/{ns}/curate", form)  # no token
    assert status == 403 and "CSRF" in html
    status, _, _ = b.request(f"/ns/{ns}/curate", {**form, "csrf": "forged"})
    assert status == 403
    # another session's token is no good either
    other = Browser(web.url)
    other.login()
    status, _, _ = b.request(f"/ns/{ns}/curate", {**form, "csrf": other.csrf()})
    assert status == 403
    assert _trainable(store, "ep0").all()  # nothing was written
    status, _, html = b.request(f"/ns/{ns}/curate", {**form, "csrf": b.csrf()})
    assert status == 200 and "Labelled 10 steps" in html
    assert not _trainable(store, "ep0").any()
    entry = store.audit_log(1)[0]
    assert entry["who"] == "claw" and entry["action"] == "curate"
    assert entry["what"]["episode"] == "ep0" and entry["what"]["trainable"] is False


def test_read_only_refuses_writes(redis_server, ns, tmp_path):
    server = WebServer(redis_server.url, tmp_path / "ro.log", "--read-only")
    try:
        b = Browser(server.url)
        b.login()
        status, _, html = b.request(f"/ns/{ns}/search")
        assert status == 200 and 'id="apply"' not in html  # no label form
        status, _, html = b.request(
            f"/ns/{ns}/curate", {"episode": "ep1", "quality": "bad", "csrf": b.csrf()}
        )
        assert status == 403 and "read-only" in html
        assert Store(redis_server.url, ns).episode("ep1", fields=[])["quality"][0] is None
    finally:
        server.stop()


def test_generated_password_is_printed_once(redis_server, tmp_path):
    server = WebServer(redis_server.url, tmp_path / "gen.log", password=None)
    try:
        out = server.output()
        found = re.findall(r"password (\S+) \(printed once", out)
        assert len(found) == 1, out
        b = Browser(server.url)
        b.login(found[0])
        assert b.request("/")[0] == 200
        assert Browser(server.url).request("/login", {"user": "claw", "password": "pw"})[0] == 401
    finally:
        server.stop()


def test_curate_free_tags_through_the_change_log(redis_server):
    ns = f"tags-{uuid.uuid4().hex[:8]}"
    store = fill(redis_server.url, ns, episodes=2, length=10)
    index = SamplingIndex(store)
    index.sync()
    assert store.curate(episode_id="ep1", tags={"label": "golden", "level": 7}, by="ana") == 10
    changed = index.sync()
    assert changed is not None and len(changed) == 10  # applied from the log, not rebuilt
    got = store.episode("ep1", fields=[])
    assert list(got["tags.label"]) == ["golden"] * 10 and (got["tags.level"] == 7).all()
    rows = np.flatnonzero(index.columns["t:level"] == 7)
    assert sorted(index.columns["id"][rows].tolist()) == sorted(got["id"].tolist())
    assert store.episode("ep0", fields=[])["tags.label"][0] == "plain"
    entry = store.audit_log(1)[0]
    assert entry["who"] == "ana" and entry["what"]["tags"] == {"label": "golden", "level": 7}
    with pytest.raises(ValueError, match="not in the namespace schema"):
        store.curate(episode_id="ep1", tags={"nope": "x"})
    with pytest.raises(ValueError, match="holds numbers"):
        store.curate(episode_id="ep1", tags={"level": "high"})


def test_episode_table_matches_numpy_on_interleaved_rows(redis_server):
    """Episodes whose steps interleave in the rows (runs of one step) are grouped right."""
    ns = f"mix-{uuid.uuid4().hex[:8]}"
    store = Store(redis_server.url, ns)
    store.create(capacity=1000, n_shards=1)
    rng = np.random.default_rng(3)
    n, k = 90, 3
    ep = np.tile(np.arange(k), n // k)  # ep0, ep1, ep2, ep0, ...
    reward = rng.uniform(-1, 1, n).astype(np.float32)
    store.commit(
        StepBatch(
            episode=StrColumn([f"e{i}" for i in range(k)], ep.astype(np.int32)),
            step_index=np.repeat(np.arange(n // k), k),
            reward=reward,
            terminated=np.zeros(n, bool),
            truncated=np.zeros(n, bool),
            fields={"x": rng.standard_normal((n, 2)).astype(np.float32)},
        )
    )
    inspector = Inspector(redis_server.url, redis_server.url)
    try:
        result = inspector.search(ns, "reward > 0", "", "episodes", 0)
    finally:
        inspector.close()
    hit = reward > 0
    assert result.matched == int(hit.sum())
    got = {row["episode"]: (row["steps"], row["reward"]) for row in result.rows}
    want = {
        f"e{i}": (int((hit & (ep == i)).sum()), float(reward[hit & (ep == i)].sum()))
        for i in range(k)
    }
    assert got.keys() == want.keys()
    for name, (steps, total) in want.items():
        assert got[name][0] == steps and got[name][1] == pytest.approx(total, rel=1e-5)


def test_pages_of_a_missing_namespace_are_404(web, ns):
    """A well-formed name no namespace has: each page says so with a 404."""
    b = Browser(web.url)
    b.login()
    missing = f"missing-{uuid.uuid4().hex[:6]}"
    for route in ("search", "quality", "audit", "recipes"):
        status, _, html = b.request(f"/ns/{missing}/{route}")
        assert status == 404 and "does not exist" in html, route
    status, _, _ = b.request(f"/ns/{ns}/quality")
    assert status == 200

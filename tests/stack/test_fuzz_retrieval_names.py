"""Hypothesis over what a caller names and counts in retrieval, snapshots and lineage:
``nearest``'s ``k``, states, index, ``where`` and fields; snapshot names; lineage step ids
and policies — through the Python API, the `claw` commands and the web inspector. Each
call either answers (and the answer is well formed: k neighbours per state, a finite
distance for every one found, a snapshot listed under the name it was given) or refuses
with a ``ValueError``/``LookupError`` (the CLI: exit 1 or 2, no traceback; the web: 4xx).

The CI variants draw a few dozen examples each; ``-m slow`` draws hundreds.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator.delivery.lineage import LineageLog
from orchestrator.maintenance import snapshots
from orchestrator.maintenance.vectors import update_indexes
from orchestrator.retrieval import define_index, nearest
from tests.stack.test_cli_hostile import check, run_in_process
from tests.stack.test_retrieval import steps
from tests.support.webserver import WebServer

NS = "fuzzret"
DIM = 8
CLEAN = (ValueError, LookupError)
"""What a refusal raises (SpecError, FilterError, RecipeError, NamespaceError among them)."""

# ---- strategies ----------------------------------------------------------------------------
hostile_text = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(min_codepoint=128, exclude_categories=["Cs"]), min_size=1),
    st.sampled_from(["x\n", "a b", "{x}", "a:b", "[/]", "..", "", "snap", "default"]),
    st.integers().map(str),
    st.just("x" * 100_000),
)
names = st.one_of(st.from_regex(r"[A-Za-z0-9_.-]{1,40}", fullmatch=True), hostile_text)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63), 10**20]),
)
ks = st.one_of(
    st.integers(min_value=-5, max_value=1100),
    numbers,
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.booleans(),
    st.text(max_size=4),
)
wheres = st.one_of(
    st.none(),
    st.sampled_from(["", "id <= 5", "tags.origin == 'expert'", "reward > 1e400", "id >"]),
    st.text(max_size=30),
)
fields = st.lists(st.one_of(st.sampled_from(["action", "obs", "reward", "id"]), names), max_size=3)


def states_for(draw_m: int, dim: int, values: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(st.lists(values, min_size=dim, max_size=dim), min_size=draw_m, max_size=draw_m)


floats = st.floats(allow_nan=True, allow_infinity=True, width=64)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[tuple[str, Store, WebServer]]:
    """A private redis-server: ``fuzzret`` with 300 steps, an exact vector index over
    ``obs`` built and a snapshot ``snap``; a `claw web` process on it."""
    with RedisServer() as server:
        store = Store(server.url, NS)
        store.create(capacity=1000, n_shards=2)
        x = np.random.default_rng(0).standard_normal((300, DIM)).astype(np.float32)
        store.commit(steps(x, "e0", "expert"))
        define_index(store, {"name": "default", "field": "obs", "kind": "exact"})
        while update_indexes(store).get("default", {}).get("pending", 1):
            pass
        snapshots.take(store, "snap")
        web = WebServer(server.url, tmp_path_factory.mktemp("web") / "web.log")
        try:
            yield server.url, store, web
        finally:
            web.stop()


# ---- API -------------------------------------------------------------------------------
def api_nearest(store: Store, data: st.DataObject) -> None:
    k = data.draw(ks, label="k")
    m = data.draw(st.integers(0, 3), label="m")
    dim = data.draw(st.sampled_from([DIM, DIM, 1, 0, 9]), label="dim")
    states = np.asarray(data.draw(states_for(m, dim, floats), label="states"), np.float64)
    index = data.draw(st.one_of(st.just("default"), names), label="index")
    where = data.draw(wheres, label="where")
    want = data.draw(fields, label="fields")
    try:
        got = nearest(store, states.reshape(m, dim), k, index=index, where=where, fields=want)
    except CLEAN:
        return
    assert got.ids.shape == (m, k) and got.distances.shape == (m, k)
    found = got.ids >= 0
    assert np.isfinite(got.distances[found]).all() or not np.isfinite(states).all()
    assert (got.ids[found] >= 1).all() and (got.ids[found] <= 300).all()


def api_names(store: Store, data: st.DataObject) -> None:
    name = data.draw(names, label="snapshot")
    try:
        info = snapshots.take(store, name)
    except CLEAN:
        return
    try:
        assert info.name == name and name in {s.name for s in store.snapshots()}
    finally:
        if name != "snap":
            store.drop_snapshot(name)
    log = LineageLog(store)
    ids = data.draw(st.lists(numbers, max_size=5), label="step ids")
    try:
        got = log.policies(np.asarray(ids, np.int64))
    except (OverflowError, *CLEAN):  # the caller's int64 conversion refuses past 2**63
        return
    assert set(got) <= set(ids)
    assert log.trained(data.draw(hostile_text, label="policy")) == []


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
MANY = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(data=st.data())
def test_nearest_arguments_through_the_api(world, data):
    api_nearest(world[1], data)


@SETTINGS
@given(data=st.data())
def test_snapshot_names_and_lineage_numbers_through_the_api(world, data):
    api_names(world[1], data)


@pytest.mark.slow
@MANY
@given(data=st.data())
def test_nearest_arguments_through_the_api_many(world, data):
    api_nearest(world[1], data)


@pytest.mark.slow
@MANY
@given(data=st.data())
def test_snapshot_names_and_lineage_numbers_through_the_api_many(world, data):
    api_names(world[1], data)


# ---- CLI -------------------------------------------------------------------------------
def cli(url: str, data: st.DataObject) -> None:
    text = st.one_of(hostile_text, numbers.map(str), floats.map(str))
    argv = data.draw(
        st.one_of(
            st.tuples(st.just("nearest"), st.just("--k"), text, st.just("--of"), text),
            st.tuples(st.just("nearest"), st.just("--state"), text, st.just("--where"), text),
            st.tuples(st.just("nearest"), st.just("--index"), names, st.just("--fields"), text),
            st.tuples(st.just("snapshot"), st.just("--delete"), names),
            st.tuples(st.just("snapshot"), names),
            st.tuples(st.just("lineage"), st.just("--step"), text),
            st.tuples(st.just("lineage"), st.just("--policy"), text, st.just("--ids")),
            st.tuples(st.just("lineage"), st.just("--episode"), text),
            st.tuples(st.just("diff"), names, names),
            st.tuples(st.just("rollback"), st.just("--to"), names),
        ),
        label="argv",
    )
    command, *rest = argv
    positional = (
        [a for a in rest if not a.startswith("--")] if command in ("snapshot", "diff") else []
    )
    options = [a for a in rest if a not in positional]
    full = [command, *options, "--", NS, *positional]
    out = run_in_process(full, url)
    check(command, full, out)
    if command == "snapshot" and out.code == 0 and "--delete" not in options:
        Store(url, NS).drop_snapshot(positional[0])


@SETTINGS
@given(data=st.data())
def test_names_and_numbers_through_the_cli(world, data):
    cli(world[0], data)


@pytest.mark.slow
@MANY
@given(data=st.data())
def test_names_and_numbers_through_the_cli_many(world, data):
    cli(world[0], data)


# ---- web -------------------------------------------------------------------------------
def web_get(web: WebServer, client: httpx.Client, data: st.DataObject) -> None:
    quote = lambda s: urllib.parse.quote(s, safe="")  # noqa: E731
    # A URL is at most 64 KiB on the client's side (httpx): names up to 8 KiB here.
    ns = data.draw(st.one_of(st.just(NS), names), label="ns")[:8192]
    number = str(data.draw(st.one_of(numbers, floats), label="number"))
    route = data.draw(
        st.sampled_from(
            [
                f"/ns/{quote(ns)}/snapshots",
                f"/ns/{quote(ns)}/thumb/{quote(number)}/obs.png",
                f"/ns/{quote(ns)}/episode?e=e0&page={quote(number)}",
                f"/ns/{quote(ns)}/search?page={quote(number)}",
                f"/ns/{quote(ns)}/audit",
            ]
        ),
        label="route",
    )
    r = client.get(route)
    assert r.status_code < 500, (route[:200], r.status_code, r.text[:300])


@pytest.fixture(scope="module")
def browser(world) -> Iterator[httpx.Client]:
    web = world[2]
    c = httpx.Client(base_url=web.url, timeout=60)
    assert c.post("/login", data={"user": "claw", "password": "pw"}).status_code == 303
    yield c
    c.close()


@SETTINGS
@given(data=st.data())
def test_names_and_numbers_through_the_web(world, browser, data):
    web_get(world[2], browser, data)


@pytest.mark.slow
@MANY
@given(data=st.data())
def test_names_and_numbers_through_the_web_many(world, browser, data):
    web_get(world[2], browser, data)


def test_the_fuzzed_namespace_still_answers(world, browser):
    """After the storms: a query answers, the snapshot is there, the inspector serves."""
    store = world[1]
    got = nearest(store, np.zeros((1, DIM), np.float32), 3, fields=["action"])
    assert (got.ids >= 1).all()
    assert "snap" in {s.name for s in store.snapshots()}
    assert browser.get(f"/ns/{NS}/snapshots").status_code == 200

"""The capture gateway's per-session keys, n samples per call, turn-level credit and the
Responses API, over real sockets: `claw gateway` and the vLLM-like upstream as
subprocesses, the `openai` client and plain HTTP as the agents, a real ingest worker."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from claw_tasks.format.turns import prompt_key
from claw_tasks.store import Store
from claw_tasks.store.turns import turn_infos
from orchestrator.inspect.query import Query
from tests.stack.test_gateway import assert_recorded, upstream_log, wait_steps
from tests.support.gateway import (
    REWARD_TOKEN,
    TOKEN,
    start_gateway,
    start_upstream,
    train_tokenizer,
)

ADMIN = "admin-secret-789"
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def stack(redis_server, ingest_worker, tmp_path_factory) -> Iterator[dict]:
    """The upstream and one gateway (admin token set, turn discount 0.9) in front of it."""
    tmp = tmp_path_factory.mktemp("sessions")
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    upstream = start_upstream(tokenizer, tmp / "upstream.log")
    namespace = f"gw-s-{uuid.uuid4().hex[:8]}"
    try:
        gw = start_gateway(
            upstream.url,
            namespace,
            tmp,
            "--turn-discount",
            "0.9",
            redis_url=redis_server.url,
            env={"CLAW_GATEWAY_ADMIN_TOKEN": ADMIN},
        )
    except Exception:
        upstream.stop()
        raise
    gw.namespace = namespace
    yield {"upstream": upstream, "gw": gw, "redis_url": redis_server.url}
    gw.stop()
    upstream.stop()


@pytest.fixture(scope="module")
def gw(stack):
    return stack["gw"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_session(gw, **body) -> dict:
    r = httpx.post(gw.url + "/sessions", json=body, headers=bearer(ADMIN))
    assert r.status_code == 201, r.text
    return r.json()


def test_a_session_key_touches_only_its_trajectory(stack, gw):
    store = Store(stack["redis_url"], gw.namespace)
    # only the admin token makes sessions; bodies are checked
    for key in (None, TOKEN, REWARD_TOKEN, "wrong"):
        r = httpx.post(gw.url + "/sessions", json={}, headers=bearer(key) if key else {})
        assert r.status_code == 401, key
    for body in ({"group": "a b"}, {"reward": "yes"}, {"ttl_s": 0}, {"x": 1}, [1]):
        r = httpx.post(gw.url + "/sessions", json=body, headers=bearer(ADMIN))
        assert r.status_code == 400, body
    r = httpx.post(gw.url + "/sessions", content=b"x" * 5000, headers=bearer(ADMIN))
    assert r.status_code == 413
    a, b = new_session(gw, group="qa"), new_session(gw, group="qb", trajectory="sess-b")
    assert b["trajectory_uid"] == "sess-b" and a["trajectory_uid"] != b["trajectory_uid"]
    dup = httpx.post(gw.url + "/sessions", json={"trajectory": "sess-b"}, headers=bearer(ADMIN))
    assert dup.status_code == 409
    ta, tb = a["trajectory_uid"], b["trajectory_uid"]

    # the key is stored hashed, never as it is
    kept = store.r.hget(f"claw:{{{gw.namespace}}}:gw:{ta}", "key").decode()
    assert kept == hashlib.sha256(a["key"].encode()).hexdigest() and a["key"] not in kept

    # its own trajectory: by its base path, and by /v1 alone (the key names it)
    own = openai.OpenAI(base_url=gw.url + a["base_path"], api_key=a["key"], max_retries=0)
    own.chat.completions.create(model="sim", messages=ASK)
    bare = openai.OpenAI(base_url=gw.url + "/v1", api_key=a["key"], max_retries=0)
    raw = bare.chat.completions.with_raw_response.create(model="sim", messages=ASK)
    assert raw.headers["x-claw-trajectory"] == ta
    got = wait_steps(store, ta, 2)
    assert got["tags.prompt_uid"].tolist() == [prompt_key("qa")] * 2  # the session's group

    # another trajectory: not by path, header or group
    other = openai.OpenAI(base_url=f"{gw.url}/t/{tb}/g/qb/v1", api_key=a["key"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="scoped to trajectory"):
        other.chat.completions.create(model="sim", messages=ASK)
    with pytest.raises(openai.PermissionDeniedError, match="scoped to trajectory"):
        bare.chat.completions.create(
            model="sim", messages=ASK, extra_headers={"X-Claw-Trajectory": tb}
        )
    wrong_group = openai.OpenAI(base_url=f"{gw.url}/t/{ta}/g/qb/v1", api_key=a["key"])
    with pytest.raises(openai.PermissionDeniedError, match="scoped to group 'qa'"):
        wrong_group.with_options(max_retries=0).chat.completions.create(model="sim", messages=ASK)
    for url in (f"/t/{tb}/reward", f"/t/{tb}"):
        r = (
            httpx.post(gw.url + url, json={"final_reward": 1.0}, headers=bearer(a["key"]))
            if url.endswith("reward")
            else httpx.get(gw.url + url, headers=bearer(a["key"]))
        )
        assert r.status_code == 403, (url, r.text)
    # a forged key for b (its trajectory, a guessed secret) opens nothing
    forged = f"cs~{tb}~{'x' * 43}"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=gw.url + "/v1", api_key=forged, max_retries=0
        ).chat.completions.create(model="sim", messages=ASK)
    assert httpx.get(f"{gw.url}/t/{tb}", headers=bearer(forged)).status_code == 401
    r = httpx.post(f"{gw.url}/t/{tb}/reward", json={"final_reward": 1}, headers=bearer(forged))
    assert r.status_code == 401
    assert httpx.get(f"{gw.url}/t/{tb}", headers=bearer(b["key"])).json()["turns"] == 0

    # reads and the reward of its own trajectory
    state = httpx.get(f"{gw.url}/t/{ta}", headers=bearer(a["key"])).json()
    assert state["turns"] == 2 and state["group"] == "qa" and state["session"] is True
    assert raw.headers["x-claw-call-id"] in state["calls"]
    r = httpx.post(f"{gw.url}/t/{ta}/reward", json={"final_reward": 1.0}, headers=bearer(a["key"]))
    assert r.status_code == 200, r.text
    with pytest.raises(openai.ConflictError, match="is finished"):
        own.chat.completions.create(model="sim", messages=ASK)
    # a key made without the right to reward: calls yes, reward no (the scorer's token yes)
    c = new_session(gw, reward=False)
    openai.OpenAI(
        base_url=gw.url + c["base_path"], api_key=c["key"], max_retries=0
    ).chat.completions.create(model="sim", messages=ASK)
    url = f"{gw.url}/t/{c['trajectory_uid']}/reward"
    assert httpx.post(url, json={"final_reward": 0}, headers=bearer(c["key"])).status_code == 403
    assert (
        httpx.post(url, json={"final_reward": 0}, headers=bearer(REWARD_TOKEN)).status_code == 200
    )

    # keys expire with their trajectory's state
    short = new_session(gw, ttl_s=1)
    time.sleep(2.0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=gw.url + short["base_path"], api_key=short["key"], max_retries=0
        ).chat.completions.create(model="sim", messages=ASK)

    # the shared token still calls any trajectory, the keys never reach the log
    openai.OpenAI(base_url=f"{gw.url}/t/shared-1/g/qs/v1", api_key=TOKEN).chat.completions.create(
        model="sim", messages=ASK
    )
    assert len(wait_steps(store, "shared-1", 1)["id"]) == 1
    text = gw.log.read_text()
    assert all(s["key"] not in text for s in (a, b, c, short))


def test_n_samples_are_one_group_of_trajectories(stack, gw):
    store = Store(stack["redis_url"], gw.namespace)
    c = openai.OpenAI(base_url=f"{gw.url}/t/multi/g/prompt-7/v1", api_key=TOKEN, max_retries=0)
    before = len(upstream_log(stack))
    raw = c.chat.completions.with_raw_response.create(model="sim", n=8, messages=ASK)
    resp = raw.parse()
    truth = upstream_log(stack)[before:]
    assert len(resp.choices) == 8 and [t["choice"] for t in truth] == list(range(8))
    for i, ch in enumerate(resp.choices):  # the agent got each choice's ids
        assert ch.token_ids == truth[i]["response_ids"]
    infos = []
    for i in range(8):
        got = wait_steps(store, f"multi~{i}", 1)
        assert_recorded(got, [truth[i]])
        assert got["tags.prompt_uid"].tolist() == [prompt_key("prompt-7")]
        infos += turn_infos(store, got["id"])
    assert {i["call_id"] for i in infos} == {raw.headers["x-claw-call-id"]}
    assert len({tuple(t["response_ids"]) for t in truth}) == 8  # 8 different samples

    # completions, streamed (choices interleaved), no group given: the group is the call's
    # trajectory id; each choice is rewarded on its own
    cm = openai.OpenAI(base_url=f"{gw.url}/t/cm/v1", api_key=TOKEN, max_retries=0)
    before = len(upstream_log(stack))
    chunks = list(cm.completions.create(model="sim", prompt="What is 3 plus 4?", n=8, stream=True))
    truth = upstream_log(stack)[before:]
    assert {ch.choices[0].index for ch in chunks if ch.choices} == set(range(8))
    for i in range(8):
        got = wait_steps(store, f"cm~{i}", 1)
        assert_recorded(got, [truth[i]])
        assert got["tags.prompt_uid"].tolist() == [prompt_key("cm")]
        r = httpx.post(
            f"{gw.url}/t/cm~{i}/reward",
            json={"final_reward": float(i)},
            headers=bearer(REWARD_TOKEN),
        )
        assert r.status_code == 200 and r.json()["turns"] == 1
    # a choice trajectory continues as any trajectory, but does not split again
    with pytest.raises(openai.BadRequestError, match="is itself a choice"):
        openai.OpenAI(
            base_url=f"{gw.url}/t/multi~3/v1", api_key=TOKEN, max_retries=0
        ).chat.completions.create(model="sim", n=2, messages=ASK)
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        cm.completions.create(model="sim", prompt=["a", "b"])


def test_credit_by_call_discount_and_turn_versions(stack, gw):
    """Three turns generated by policy versions 3, 4, 5 (the upstream's header); rewards by
    the calls' ids; the namespace's discount 0.9 propagated back: the stored rewards equal
    a numpy reference, the versions round-trip, min/max are tags a where can use."""
    store = Store(stack["redis_url"], gw.namespace)
    up = stack["upstream"].url
    c = openai.OpenAI(base_url=f"{gw.url}/t/credit/g/qc/v1", api_key=TOKEN, max_retries=0)
    ids = []
    try:
        for v in (3, 4, 5):
            httpx.post(up + "/_version", json={"version": v})
            raw = c.chat.completions.with_raw_response.create(model="sim", messages=ASK)
            ids.append(raw.headers["x-claw-call-id"])
    finally:
        httpx.post(up + "/_version", json={"version": None})
    wait_steps(store, "credit", 3)
    state = httpx.get(f"{gw.url}/t/credit", headers=bearer(REWARD_TOKEN)).json()
    assert state["calls"] == {ids[0]: 0, ids[1]: 1, ids[2]: 2}
    assert (state["min_version"], state["max_version"]) == (3, 5)
    assert httpx.get(f"{gw.url}/t/credit", headers=bearer(TOKEN)).status_code == 401
    bad = httpx.post(
        f"{gw.url}/t/credit/reward",
        json={"final_reward": 1, "call_rewards": {"0123456789abcdef": 1}},
        headers=bearer(REWARD_TOKEN),
    )
    assert bad.status_code == 409 and "not recorded turns" in bad.text
    for body in (
        {"final_reward": 1, "call_rewards": {"nope": 1}},
        {"final_reward": 1, "call_rewards": {ids[0]: "1"}},
        {"final_reward": 1, "call_rewards": {ids[0]: 1}, "turn_rewards": [1, 0, 0]},
        {"final_reward": 1, "call_rewards": [1]},
    ):
        r = httpx.post(f"{gw.url}/t/credit/reward", json=body, headers=bearer(REWARD_TOKEN))
        assert r.status_code == 400, body
    r = httpx.post(
        f"{gw.url}/t/credit/reward",
        json={"final_reward": 1.0, "call_rewards": {ids[0]: 0.5, ids[2]: 0.25}},
        headers=bearer(REWARD_TOKEN),
    )
    assert r.status_code == 200, r.text
    got = store.episode("credit", fields=[])
    assert got["policy_version"].tolist() == [3, 4, 5]
    immediate = np.array([0.5, 0.0, 0.25 + 1.0])  # the last turn also holds the outcome
    gamma = 0.9
    powers = np.triu(gamma ** (np.arange(3)[None, :] - np.arange(3)[:, None]))
    np.testing.assert_allclose(got["reward"], powers @ immediate, rtol=1e-6)
    assert got["tags.final_reward"].tolist() == [1.0] * 3
    assert got["tags.min_version"].tolist() == [3.0] * 3
    assert got["tags.max_version"].tolist() == [5.0] * 3
    q = Query(store)
    ep = q.key("episode_id")
    assert ep.kind == "episode"
    hit = q.match("tags.min_version >= 3 and tags.max_version <= 5")[1]
    assert sorted(q.index.columns["id"][hit].tolist()) == sorted(got["id"].tolist())
    assert len(q.match("tags.min_version >= 4")[1]) == 0


def test_responses_api_is_recorded_like_chat(stack, gw):
    store = Store(stack["redis_url"], gw.namespace)
    for traj, stream in (("resp-plain", False), ("resp-stream", True)):
        c = openai.OpenAI(base_url=f"{gw.url}/t/{traj}/g/qr/v1", api_key=TOKEN, max_retries=0)
        before = len(upstream_log(stack))
        if stream:
            events = list(c.responses.create(model="sim", input="What is 2 plus 2?", stream=True))
            assert events[-1].type == "response.completed"
            text = events[-1].response.output_text
        else:
            text = c.responses.create(
                model="sim", input="What is 2 plus 2?", instructions="Be brief."
            ).output_text
        assert text == "ok, done"
        got = wait_steps(store, traj, 1)
        assert_recorded(got, upstream_log(stack)[before:])
        info = turn_infos(store, got["id"])[0]
        assert '"content":"What is 2 plus 2?"' in info["messages"]
    a = store.episode("resp-plain", fields=["response_ids"])["response_ids"][0]
    b = store.episode("resp-stream", fields=["response_ids"])["response_ids"][0]
    np.testing.assert_array_equal(a, b)


def test_a_session_key_reaches_only_the_choices_of_its_own_calls(stack, gw):
    """The attack: a key for trajectory S names ``S~7`` (or ``S~07``) in the path with n=1,
    to open trajectories (and admission slots) no call of its own split into, and goes on
    after S's reward. A key reaches S and the ``S~i`` choices of its own n > 1 calls (i < n);
    once S's reward is posted it opens nothing more."""
    store = Store(stack["redis_url"], gw.namespace)
    s = new_session(gw, group="qn")
    traj, key = s["trajectory_uid"], s["key"]

    def call(path_traj: str, n: int = 1):
        c = openai.OpenAI(base_url=f"{gw.url}/t/{path_traj}/v1", api_key=key, max_retries=0)
        return c.chat.completions.create(model="sim", messages=ASK, n=n)

    def state(t: str) -> httpx.Response:
        return httpx.get(f"{gw.url}/t/{t}", headers=bearer(REWARD_TOKEN))

    # no call of its own split yet: no choice is its
    for forged in (f"{traj}~7", f"{traj}~0", f"{traj}~9999"):
        with pytest.raises(openai.PermissionDeniedError, match="not a choice"):
            call(forged)
        assert state(forged).status_code == 404, forged  # nothing opened
    with pytest.raises(openai.BadRequestError):  # not a choice's spelling at all
        call(f"{traj}~07")
    # its own n=3 call: S~0..S~2 are its, S~3 is not
    assert len(call(traj, n=3).choices) == 3
    for i in range(3):
        wait_steps(store, f"{traj}~{i}", 1)
    assert len(call(f"{traj}~1").choices) == 1
    wait_steps(store, f"{traj}~1", 2)
    with pytest.raises(openai.PermissionDeniedError, match="not a choice"):
        call(f"{traj}~3")
    assert state(f"{traj}~3").status_code == 404
    assert httpx.get(f"{gw.url}/t/{traj}~2", headers=bearer(key)).json()["turns"] == 1
    assert httpx.get(f"{gw.url}/t/{traj}~3", headers=bearer(key)).status_code == 403
    r = httpx.post(f"{gw.url}/t/{traj}~3/reward", json={"final_reward": 1}, headers=bearer(key))
    assert r.status_code == 403, r.text
    r = httpx.post(f"{gw.url}/t/{traj}~0/reward", json={"final_reward": 1}, headers=bearer(key))
    assert r.status_code == 200, r.text

    # S's own turn and its reward end the key: no call of S, a choice, or a new one
    call(traj)
    wait_steps(store, traj, 1)
    r = httpx.post(f"{gw.url}/t/{traj}/reward", json={"final_reward": 1}, headers=bearer(key))
    assert r.status_code == 200, r.text
    r = httpx.post(f"{gw.url}/t/{traj}/reward", json={"final_reward": 1}, headers=bearer(key))
    assert r.status_code == 200, r.text  # the same reward posted again (its reply lost)
    r = httpx.post(f"{gw.url}/t/{traj}/reward", json={"final_reward": 0}, headers=bearer(key))
    assert r.status_code == 409 and "already has its reward" in r.text, r.text
    for t, n in ((traj, 1), (f"{traj}~2", 1), (f"{traj}~7", 1), (traj, 2)):
        with pytest.raises((openai.ConflictError, openai.PermissionDeniedError)):
            call(t, n)
    assert state(f"{traj}~7").status_code == 404
    assert state(f"{traj}~2").json()["turns"] == 1  # nothing recorded after the reward
    r = httpx.post(f"{gw.url}/t/{traj}~2/reward", json={"final_reward": 1}, headers=bearer(key))
    assert r.status_code == 409, r.text
    assert httpx.get(f"{gw.url}/t/{traj}", headers=bearer(key)).json()["finished"] is True


def test_an_id_with_a_trailing_newline_is_refused_and_not_forwarded(stack, gw):
    """The attack: ``/t/abc%0A/...`` passes a ``^...$`` check (``$`` matches before a final
    newline), goes upstream, and the reply's ``X-Claw-Trajectory`` header cannot be sent."""
    before = len(upstream_log(stack))
    body = {"model": "sim", "messages": ASK}
    for path in ("/t/abc%0A/v1/chat/completions", "/t/abc/g/q%0A/v1/chat/completions"):
        r = httpx.post(gw.url + path, json=body, headers=bearer(TOKEN))
        assert r.status_code == 400, (path, r.text)
    r = httpx.post(
        f"{gw.url}/t/abc%0A/reward", json={"final_reward": 1}, headers=bearer(REWARD_TOKEN)
    )
    assert r.status_code == 400, r.text
    assert len(upstream_log(stack)) == before  # nothing went upstream

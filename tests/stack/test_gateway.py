"""The capture gateway over real sockets: the `openai` client runs agent loops with tool
calls through `claw gateway` (a subprocess) against a vLLM-like upstream (another
subprocess, tests/llm_upstream.py); a real ingest worker commits the turns."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from claw_tasks.format.turns import prompt_key
from claw_tasks.store import Store
from claw_tasks.store.turns import turn_infos
from orchestrator.delivery import admission
from orchestrator.gateway.capture import CHAT, CaptureError, Retokenizer, capture
from orchestrator.gateway.recorder import TURN, reward_digest
from tests.support.gateway import (
    REWARD_TOKEN,
    TOKEN,
    Proc,
    gateway_argv,
    start_gateway,
    start_upstream,
    train_tokenizer,
)
from tests.support.processes import free_port

FIELDS = ["prompt_ids", "response_ids", "response_logprobs"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def stack(redis_server, ingest_worker, tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("gateway")
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    upstream = start_upstream(tokenizer, tmp / "upstream.log")
    procs = [upstream]

    def gateway(
        namespace: str, *extra: str, upstream_url: str = upstream.url, env: dict | None = None
    ) -> Proc:
        p = start_gateway(upstream_url, namespace, tmp, *extra, redis_url=redis_server.url, env=env)
        procs.append(p)
        return p

    namespace = f"gw-{uuid.uuid4().hex[:8]}"
    main = gateway(namespace, "--max-body-bytes", "3000", "--max-turns", "2")
    yield {
        "upstream": upstream,
        "gateway": gateway,
        "tokenizer": tokenizer,
        "main": main,
        "redis_url": redis_server.url,
        "namespace": namespace,
    }
    for p in reversed(procs):
        p.stop()


def upstream_log(stack: dict) -> list[dict]:
    return httpx.get(stack["upstream"].url + "/_log").json()


def client(gw, traj: str, group: str | None = "g", key: str = TOKEN) -> openai.OpenAI:
    base = f"{gw.url}/t/{traj}/g/{group}/v1" if group else f"{gw.url}/t/{traj}/v1"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0)


def agent(c: openai.OpenAI, question: str, stream: bool) -> dict:
    """A tool-using agent loop; returns its answer and the ids/log-probs it was sent."""
    messages: list[dict] = [
        {"role": "system", "content": "You add numbers with the tool."},
        {"role": "user", "content": question},
    ]
    seen = []
    for _ in range(4):
        if stream:
            content, calls, ids, lps, prompt = "", {}, [], [], None
            for chunk in c.chat.completions.create(
                model="sim", messages=messages, tools=TOOLS, stream=True
            ):
                prompt = getattr(chunk, "prompt_token_ids", None) or prompt
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                ids += getattr(ch, "token_ids", None) or []
                if ch.logprobs and ch.logprobs.content:
                    lps += [e.logprob for e in ch.logprobs.content]
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    cur = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
                    cur["id"] = tc.id or cur["id"]
                    cur["name"] += tc.function.name or ""
                    cur["args"] += tc.function.arguments or ""
            tool_calls = [(v["id"], v["name"], v["args"]) for _, v in sorted(calls.items())]
        else:
            resp = c.chat.completions.create(model="sim", messages=messages, tools=TOOLS)
            msg = resp.choices[0].message
            content = msg.content or ""
            tool_calls = [
                (t.id, t.function.name, t.function.arguments) for t in msg.tool_calls or []
            ]
            prompt = getattr(resp, "prompt_token_ids", None)
            ids = getattr(resp.choices[0], "token_ids", None)
            lps = [e.logprob for e in resp.choices[0].logprobs.content]
        seen.append({"prompt_ids": prompt, "response_ids": ids, "logprobs": lps})
        if not tool_calls:
            return {"answer": content, "seen": seen}
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                    for i, n, a in tool_calls
                ],
            }
        )
        for i, _, a in tool_calls:
            args = json.loads(a)
            result = str(args["a"] + args["b"])
            messages.append({"role": "tool", "tool_call_id": i, "content": result})
    raise AssertionError("agent did not finish")


def wait_steps(store: Store, traj: str, n: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = store.episode(traj, fields=FIELDS)
            if len(got["id"]) >= n:
                return got
        except KeyError:
            pass
        assert time.monotonic() < deadline, f"trajectory {traj} never reached {n} steps"
        time.sleep(0.05)


def assert_recorded(got: dict, truth: list[dict]) -> None:
    assert len(got["id"]) == len(truth)
    for t, want in enumerate(truth):
        assert got["prompt_ids"][t].tolist() == want["prompt_ids"]
        assert got["response_ids"][t].tolist() == want["response_ids"]
        np.testing.assert_array_equal(got["response_logprobs"][t], np.float32(want["logprobs"]))


def test_agent_loops_record_what_the_upstream_returned(stack):
    gw = stack["main"]
    store = Store(stack["redis_url"], stack["namespace"])
    runs = []
    for k, (stream, group) in enumerate([(False, "q1"), (True, "q1"), (False, "q2")]):
        before = len(upstream_log(stack))
        out = agent(client(gw, f"traj-{k}", group), f"What is {k + 3} plus {k * 10}?", stream)
        assert out["answer"] == f"The answer is {2 * k + 3 + 9 * k}."
        truth = upstream_log(stack)[before:]
        assert len(truth) == 2  # the tool call, then the answer
        for saw, want in zip(out["seen"], truth, strict=True):  # the agent got vLLM's fields
            assert saw["prompt_ids"] == want["prompt_ids"]
            assert saw["response_ids"] == want["response_ids"]
            assert saw["logprobs"] == pytest.approx(want["logprobs"])
        runs.append((f"traj-{k}", group, truth))
    for traj, group, truth in runs:
        got = wait_steps(store, traj, 2)
        assert_recorded(got, truth)
        assert got["step_index"].tolist() == [0, 1]
        assert got["tags.prompt_uid"].tolist() == [prompt_key(group)] * 2
        assert got["tags.retokenized"].tolist() == [0.0, 0.0]
        assert not got["terminated"].any()
        infos = turn_infos(store, got["id"])
        assert [i["prompt_uid"] for i in infos] == [group, group]
        first_calls = json.loads(infos[0]["tool_calls"])
        assert first_calls[0]["function"]["name"] == "add"
        assert "tool_calls" not in infos[1]
        msgs = json.loads(infos[1]["messages"])
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert httpx.get(gw.url + "/metrics").status_code == 401  # never open
    wrong = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {REWARD_TOKEN}"})
    assert wrong.status_code == 401 and "CLAW_GATEWAY_TOKEN" in wrong.json()["error"]["message"]
    metrics = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert "claw_gateway_recorded_turns_total 6.0" in metrics


def test_metrics_token(stack):
    """With CLAW_METRICS_TOKEN set, /metrics takes that token and no other."""
    gw = stack["gateway"](f"gw-{uuid.uuid4().hex[:8]}", env={"CLAW_METRICS_TOKEN": "scrape-789"})
    for key, status in ((None, 401), (TOKEN, 401), ("scrape-789", 200)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(gw.url + "/metrics", headers=headers).status_code == status, key


def scrape(gw: Proc) -> str:
    return httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text


def test_turn_indices_shared_by_gateways_and_restarts(stack):
    """Two gateway processes serve one trajectory alternately, one is restarted midway:
    the turns are numbered 0..5 without gaps, and a reward posted to either covers all."""
    namespace = f"gw-{uuid.uuid4().hex[:8]}"
    a, b = stack["gateway"](namespace), stack["gateway"](namespace)
    store = Store(stack["redis_url"], namespace)
    ask = [{"role": "user", "content": "hello"}]
    seen = []
    for gw in (a, b, a, b):
        resp = client(gw, "shared", "q").chat.completions.create(model="sim", messages=ask)
        seen.append(getattr(resp.choices[0], "token_ids", None))
    a.stop()  # its Ingestor flushes on the way out; the next gateway starts from Redis
    c = stack["gateway"](namespace)
    for gw in (c, b):
        resp = client(gw, "shared", "q").chat.completions.create(model="sim", messages=ask)
        seen.append(getattr(resp.choices[0], "token_ids", None))
    auth = {"Authorization": f"Bearer {REWARD_TOKEN}"}
    r = httpx.post(c.url + "/t/shared/reward", json={"final_reward": 2.0}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["turns"] == 6
    got = store.episode("shared", fields=["response_ids"])
    assert got["step_index"].tolist() == [0, 1, 2, 3, 4, 5]
    assert [x.tolist() for x in got["response_ids"]] == seen
    assert got["terminated"].tolist() == [False] * 5 + [True]
    assert got["reward"].tolist() == [0.0] * 5 + [2.0]
    # b does not know the reward was posted through c: it answers, but records nothing
    client(b, "shared", "q").chat.completions.create(model="sim", messages=ask)
    deadline = time.monotonic() + 30
    while 'claw_gateway_unrecorded_calls_total{reason="finished"} 1.0' not in scrape(b):
        assert time.monotonic() < deadline, scrape(b)
        time.sleep(0.05)
    again = httpx.post(b.url + "/t/shared/reward", json={"final_reward": 0.0}, headers=auth)
    assert again.status_code == 409 and "already has its reward" in again.text
    assert len(store.episode("shared", fields=[])["id"]) == 6


def test_stream_and_plain_record_the_same_step(stack):
    gw = stack["main"]
    store = Store(stack["redis_url"], stack["namespace"])
    agent(client(gw, "plain", "q"), "What is 5 plus 9?", stream=False)
    agent(client(gw, "streamed", "q"), "What is 5 plus 9?", stream=True)
    a, b = wait_steps(store, "plain", 2), wait_steps(store, "streamed", 2)
    for name in FIELDS:
        for x, y in zip(a[name], b[name], strict=True):
            np.testing.assert_array_equal(x, y)
    ia, ib = turn_infos(store, a["id"]), turn_infos(store, b["id"])
    for x, y in zip(ia, ib, strict=True):
        assert x["messages"] == y["messages"]
        assert x.get("tool_calls") == y.get("tool_calls")
    assert json.loads(ia[0]["tool_calls"])[0]["function"]["arguments"] == '{"a": 5, "b": 9}'

    # /v1/completions, both ways, identity in headers instead of the path
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=TOKEN, max_retries=0)
    for traj, stream in (("cmpl-plain", False), ("cmpl-stream", True)):
        before = len(upstream_log(stack))
        resp = c.completions.create(
            model="sim",
            prompt="What is 3 plus 4?",
            stream=stream,
            extra_headers={
                "X-Claw-Trajectory": traj,
                "X-Claw-Group": "c",
                "X-Claw-Tags": "task=add,difficulty=2",
            },
        )
        text = "".join(ch.choices[0].text for ch in resp) if stream else resp.choices[0].text
        assert text == " the sum is seven"
        got = wait_steps(store, traj, 1)
        assert_recorded(got, upstream_log(stack)[before:])
        store.config(refresh=True)  # the tags came with these steps
        got = store.episode(traj, fields=[])
        assert got["tags.task"] == ["add"] and got["tags.difficulty"].tolist() == [2.0]


def test_reward_after_the_fact_reaches_the_right_steps(stack):
    gw = stack["main"]
    store = Store(stack["redis_url"], stack["namespace"])
    for k in range(3):
        agent(client(gw, f"r{k}", "q"), f"What is {k} plus 1?", stream=k == 1)
    url = gw.url + "/t/r1/reward"
    auth = {"Authorization": f"Bearer {REWARD_TOKEN}"}
    r = httpx.post(
        url,
        json={"final_reward": 1.0, "turn_rewards": [0.5, 0.0], "reward_source": "verifier"},
        headers=auth,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"trajectory_uid": "r1", "turns": 2}
    r2 = httpx.post(gw.url + "/t/r2/reward", json={"final_reward": -1}, headers=auth)
    assert r2.status_code == 200, r2.text
    got = {t: store.episode(t, fields=[]) for t in ("r0", "r1", "r2")}
    assert got["r1"]["reward"].tolist() == [0.5, 1.0]
    assert got["r1"]["tags.final_reward"].tolist() == [1.0, 1.0]
    assert got["r1"]["terminated"].tolist() == [False, True]
    assert got["r1"]["reward_source"] == ["verifier", "verifier"]
    assert got["r2"]["reward"].tolist() == [0.0, -1.0]
    assert got["r2"]["terminated"].tolist() == [False, True]
    assert got["r0"]["reward"].tolist() == [0.0, 0.0]
    assert np.isnan(got["r0"]["tags.final_reward"]).all()
    assert not got["r0"]["terminated"].any()

    again = httpx.post(url, json={"final_reward": 0.0}, headers=auth)
    assert again.status_code == 409 and "already has its reward" in again.json()["error"]["message"]
    with pytest.raises(openai.ConflictError, match="is finished"):
        agent(client(gw, "r1", "q"), "What is 1 plus 1?", stream=False)
    wrong = httpx.post(
        gw.url + "/t/r0/reward", json={"final_reward": 1.0, "turn_rewards": [1.0]}, headers=auth
    )
    assert wrong.status_code == 409 and "1 turn rewards for 2" in wrong.json()["error"]["message"]
    assert store.episode("r0", fields=[])["reward"].tolist() == [0.0, 0.0]
    bad = httpx.post(gw.url + "/t/r0/reward", json={"final_reward": "1"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_reward"


def test_a_reward_posted_again_after_its_gateway_died_midway_is_taken(stack, ingest_worker):
    """A gateway SIGKILLed while it attaches a reward (the trajectory marked done, its turns
    waiting for the ingest worker): the same reward posted again to another gateway is
    taken (200, the rewards on the turns), and again after that; another reward is
    refused."""
    store = Store(stack["redis_url"], stack["namespace"])
    doomed = stack["gateway"](stack["namespace"])
    auth = {"Authorization": f"Bearer {REWARD_TOKEN}"}
    body = {"final_reward": 1.0, "turn_rewards": [0.5, 0.0]}
    posted: list = []
    os.killpg(ingest_worker.proc.pid, signal.SIGSTOP)  # the turns wait in the broker
    try:
        agent(client(doomed, "died", "q"), "What is 2 plus 2?", stream=False)
        post = threading.Thread(
            target=_post_ignoring_errors,
            args=(doomed.url + "/t/died/reward", body, auth, posted),
            daemon=True,
        )
        post.start()
        key = admission.trajectory_key(store, "died")
        deadline = time.monotonic() + 60
        while not (store.r.hexists(key, "done") and store.r.llen("ingest")):
            assert time.monotonic() < deadline, "the reward never got past its mark"
            time.sleep(0.02)
        doomed.proc.kill()  # SIGKILL: between the mark and the rewards
        doomed.proc.wait()
    finally:
        os.killpg(ingest_worker.proc.pid, signal.SIGCONT)
    wait_steps(store, "died", 2)
    url = stack["main"].url + "/t/died/reward"
    for _ in range(2):  # carried on from the mark, then answered as taken
        r = httpx.post(url, json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json() == {"trajectory_uid": "died", "turns": 2}
        got = store.episode("died", fields=[])
        assert got["reward"].tolist() == [0.5, 1.0]
        assert got["tags.final_reward"].tolist() == [1.0, 1.0]
        assert got["terminated"].tolist() == [False, True]
    other = httpx.post(url, json={"final_reward": 0.0}, headers=auth)
    assert other.status_code == 409 and "already has its reward" in other.text


def test_a_failed_post_leaves_the_reward_a_retry_of_it_attached(stack):
    """Two posts of the same reward at once (a client retried on another gateway process):
    the first one failing does not reopen what the retry attached, so no other reward is
    taken after a 200; and when it fails before the retry attaches, the attach puts the
    mark back. Another reward never marks a trajectory attached."""
    store = Store(stack["redis_url"], stack["namespace"])
    same, other = reward_digest(1.0, None, None, None), reward_digest(0.0, None, None, None)
    for uid, reopen_first in (("raced-late", False), ("raced-early", True)):
        both = [admission.trajectory_key(store, uid), admission.admission_key(store)]
        assert TURN(store.r, both, ["finish", 60, same])[0] == 1  # the first post
        assert TURN(store.r, both, ["finish", 60, same])[0] == 0  # the retry carries on
        if reopen_first:
            TURN(store.r, both, ["reopen", 60, same])  # the first post fails
        assert TURN(store.r, both, ["attached", 60, same]) == 1  # the retry is done
        TURN(store.r, both, ["reopen", 60, same])  # (again) the first post fails
        assert TURN(store.r, both, ["finish", 60, other]) == [-1]
        assert TURN(store.r, both, ["attached", 60, other]) == -1
        assert TURN(store.r, both, ["finish", 60, same])[0] == 2


def _post_ignoring_errors(url: str, body: dict, headers: dict, out: list) -> None:
    """POST whose connection may die with its server."""
    try:
        out.append(httpx.post(url, json=body, headers=headers, timeout=120))
    except httpx.HTTPError as e:
        out.append(e)


def test_auth_limits_and_upstream_failures(stack):
    gw, namespace = stack["main"], stack["namespace"]
    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        agent(client(gw, "a", key="wrong"), "What is 1 plus 2?", stream=False)
    agent(client(gw, "a"), "What is 1 plus 2?", stream=False)  # two turns: the budget
    with pytest.raises(openai.ConflictError, match="limit of 2 turns"):
        agent(client(gw, "a"), "What is 1 plus 2?", stream=False)
    with pytest.raises(openai.APIStatusError, match="over 3000 bytes") as e:
        client(gw, "b").chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "x" * 4000}]
        )
    assert e.value.status_code == 413
    for bad_n in (0, 65, "2"):
        with pytest.raises(openai.BadRequestError, match="n must be an integer from 1 to 64"):
            client(gw, "b").chat.completions.create(
                model="sim", n=bad_n, messages=[{"role": "user", "content": "hi"}]
            )
    with pytest.raises(openai.BadRequestError, match="no trajectory id"):
        no_identity = openai.OpenAI(base_url=gw.url + "/v1", api_key=TOKEN, max_retries=0)
        no_identity.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}]
        )
    # The agents' token does not open the reward endpoint, which has its own.
    r = httpx.post(
        gw.url + "/t/a/reward",
        json={"final_reward": 1.0},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # An upstream error is passed through as it came and recorded as nothing.
    with pytest.raises(openai.InternalServerError, match="model overloaded"):
        client(gw, "c").chat.completions.create(
            model="fail", messages=[{"role": "user", "content": "hi"}]
        )
    for _ in range(2):  # the failed call did not use c's turn budget
        client(gw, "c").chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}]
        )
    store = Store(stack["redis_url"], namespace)
    assert len(wait_steps(store, "c", 2)["id"]) == 2
    assert len(wait_steps(store, "a", 2)["id"]) == 2
    # An upstream that does not answer: 502 in OpenAI's shape.
    down = free_port()
    p = free_port()
    gw2 = Proc(
        gateway_argv(f"http://127.0.0.1:{down}", namespace, p, redis_url=stack["redis_url"]),
        p,
        stack["tokenizer"].parent / "gw-down.log",
        {"CLAW_GATEWAY_TOKEN": TOKEN},
    )
    try:
        with pytest.raises(openai.APIStatusError, match=r"upstream .* failed") as e:
            client(gw2, "d").chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}]
            )
        assert e.value.status_code == 502
        health = httpx.get(gw2.url + "/healthz").json()
        assert health["status"] == "ok" and health["namespace"] == namespace
    finally:
        gw2.stop()
    with pytest.raises(KeyError):
        store.episode("d", fields=[])


def test_upstream_without_token_ids_is_retokenized(stack):
    namespace = f"gw-rt-{uuid.uuid4().hex[:8]}"
    gw = stack["gateway"](namespace, "--no-vllm-options", "--tokenizer", str(stack["tokenizer"]))
    store = Store(stack["redis_url"], namespace)
    before = len(upstream_log(stack))
    out = agent(client(gw, "rt", "q"), "What is 12 plus 30?", stream=True)
    assert out["seen"][0]["prompt_ids"] is None  # the upstream sent no ids
    got = wait_steps(store, "rt", 2)
    assert_recorded(got, upstream_log(stack)[before:])
    assert got["tags.retokenized"].tolist() == [1.0, 1.0]


def test_capture_refuses_what_it_cannot_record(stack):
    """No ids and no tokenizer, or no log-probs: the call is not a step (the gateway
    answers it and counts it under claw_gateway_unrecorded_calls)."""
    retok = Retokenizer(stack["tokenizer"])
    piece = retok.tok.decode(retok.encode(" answer")[:1])  # one token of the vocabulary
    reply = {
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"content": piece},
                "logprobs": {"content": [{"token": piece, "logprob": -0.5}]},
            }
        ],
    }
    request = {"messages": [{"role": "user", "content": "hello"}]}
    raw = json.dumps(reply).encode()
    with pytest.raises(CaptureError, match="no token ids and no tokenizer"):
        capture(CHAT, request, raw, False, None)
    turn = capture(CHAT, request, raw, False, retok)
    assert turn.retokenized and turn.response_logprobs == [-0.5]
    assert turn.response_ids == retok.encode(" answer")[:1]
    reply["choices"][0]["logprobs"] = None
    with pytest.raises(CaptureError, match="no log-probs"):
        capture(CHAT, request, json.dumps(reply).encode(), False, None)


def test_recorded_logprobs_are_the_models(stack, tmp_path):
    """A tiny random GPT-2 (transformers, built from a config) serves the chat: the
    log-probs recorded through the gateway are the model's own, recomputed here."""
    import torch

    from tests.support.llm_upstream import tiny_model

    model_upstream = start_upstream(stack["tokenizer"], tmp_path / "model.log", "model")
    namespace = f"gw-model-{uuid.uuid4().hex[:8]}"
    try:
        gw = stack["gateway"](namespace, upstream_url=model_upstream.url)
        c = client(gw, "m", "q")
        messages = [{"role": "user", "content": "What is 2 plus 2?"}]
        for _ in range(2):
            r = c.chat.completions.create(model="tiny", messages=messages)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "and 3 plus 4?"},
            ]
        got = wait_steps(Store(stack["redis_url"], namespace), "m", 2)
    finally:
        model_upstream.stop()
    model = tiny_model(Tokenizer.from_file(str(stack["tokenizer"])).get_vocab_size())
    for prompt, response, recorded in zip(
        got["prompt_ids"], got["response_ids"], got["response_logprobs"], strict=True
    ):
        seq = torch.tensor([np.concatenate([prompt, response]).tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0].double(), -1)
        at = np.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        expected = logp[at, torch.tensor(response.tolist())].numpy()
        assert len(response) == 8
        np.testing.assert_allclose(recorded, expected, rtol=1e-4, atol=1e-4)
    assert len(got["prompt_ids"][1]) > len(got["prompt_ids"][0])  # turn 2 extends turn 1

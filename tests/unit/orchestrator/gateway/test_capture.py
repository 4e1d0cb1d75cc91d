"""Capture without services: a reply with n choices is n turns (streamed choices arrive
interleaved), a reply missing a choice is none; the Responses API's vLLM fields; the
request as sent upstream."""

from __future__ import annotations

import json

import pytest

from orchestrator.gateway.capture import (
    CHAT,
    COMPLETION,
    LOGPROBS_INCLUDE,
    RESPONSES,
    CaptureError,
    capture_all,
    upstream_body,
)


def chat_choice(i: int, ids: list[int]) -> dict:
    return {
        "index": i,
        "message": {"content": "x"},
        "token_ids": ids,
        "logprobs": {"content": [{"token": "t", "logprob": -0.1 * (i + 1)} for _ in ids]},
        "finish_reason": "stop",
    }


def test_n_choices_are_n_turns():
    reply = {
        "prompt_token_ids": [1, 2],
        "choices": [chat_choice(i, [10 + i, 20 + i]) for i in (2, 0, 1)],
    }
    turns = capture_all(CHAT, {"messages": []}, json.dumps(reply).encode(), False, None, n=3)
    assert [t.response_ids for t in turns] == [[10, 20], [11, 21], [12, 22]]
    assert [t.prompt_ids for t in turns] == [[1, 2]] * 3
    assert turns[2].response_logprobs == pytest.approx([-0.3, -0.3])
    with pytest.raises(CaptureError, match="no choice 3"):
        capture_all(CHAT, {"messages": []}, json.dumps(reply).encode(), False, None, n=4)


def test_a_log_prob_that_is_not_a_number_is_refused():
    """JSON ``true`` is a bool, not the log-prob 1.0 (both APIs refuse it)."""
    choice = chat_choice(0, [10, 20])
    choice["logprobs"]["content"][1]["logprob"] = True
    reply = json.dumps({"prompt_token_ids": [1], "choices": [choice]}).encode()
    with pytest.raises(CaptureError, match="no log-probs"):
        capture_all(CHAT, {"messages": []}, reply, False, None, n=1)


def test_streamed_completion_choices_interleave():
    events = []
    for pos in range(2):
        for i in range(2):
            c = {
                "index": i,
                "text": "a",
                "token_ids": [100 * i + pos],
                "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0 - pos]},
            }
            if pos == 0:
                c["prompt_token_ids"] = [7, 8, i]
            events.append(f"data: {json.dumps({'choices': [c]})}\n\n")
    raw = ("".join(events) + "data: [DONE]\n\n").encode()
    turns = capture_all(COMPLETION, {"prompt": "p"}, raw, True, None, n=2)
    assert [t.response_ids for t in turns] == [[0, 1], [100, 101]]
    assert [t.prompt_ids for t in turns] == [[7, 8, 0], [7, 8, 1]]
    assert turns[1].response_logprobs == [-1.0, -2.0]


def response(with_messages: bool = True) -> dict:
    out = {
        "model": "m",
        "status": "completed",
        "output": [
            {"type": "reasoning", "content": []},
            {
                "type": "message",
                "content": [
                    {
                        "type": "output_text",
                        "text": "hi",
                        "logprobs": [
                            {"token": "h", "logprob": -0.5},
                            {"token": "i", "logprob": -0.25},
                        ],
                    }
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        ],
    }
    if with_messages:
        out["input_messages"] = [
            {"message": "p", "tokens": [1, 2, 3], "type": "raw_message_tokens"}
        ]
        out["output_messages"] = [
            {"message": "hi", "tokens": [40, 41], "type": "raw_message_tokens"}
        ]
    return out


def test_responses_api_turn():
    request = {"input": "hello", "instructions": "be brief"}
    (turn,) = capture_all(RESPONSES, request, json.dumps(response()).encode(), False, None)
    assert (turn.prompt_ids, turn.response_ids) == ([1, 2, 3], [40, 41])
    assert turn.response_logprobs == [-0.5, -0.25] and turn.finish_reason == "completed"
    assert turn.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    assert turn.tool_calls[0]["function"]["name"] == "add"
    stream = (
        'event: response.created\ndata: {"type": "response.created", "response": {}}\n\n'
        "event: response.completed\ndata: "
        + json.dumps({"type": "response.completed", "response": response()})
        + "\n\n"
    ).encode()
    (streamed,) = capture_all(RESPONSES, request, stream, True, None)
    assert streamed.response_ids == turn.response_ids
    with pytest.raises(CaptureError, match="no token ids"):
        capture_all(RESPONSES, request, json.dumps(response(False)).encode(), False, None)
    two = response()
    two["output_messages"] *= 2
    with pytest.raises(CaptureError, match="one generation"):
        capture_all(RESPONSES, request, json.dumps(two).encode(), False, None)
    with pytest.raises(CaptureError, match=r"no response\.completed"):
        capture_all(RESPONSES, request, b"event: x\ndata: {}\n\n", True, None)


def test_upstream_body():
    sent = upstream_body(RESPONSES, {"input": "x", "include": ["a"]}, True)
    assert sent["include"] == ["a", LOGPROBS_INCLUDE] and sent["enable_response_messages"]
    assert sent["top_logprobs"] == 0
    assert upstream_body(CHAT, {"n": 4}, True, max_n=8)["n"] == 4
    for bad in ({"n": 9}, {"n": 0}, {"n": True}, {"n": 1.5}):
        with pytest.raises(CaptureError, match="n must be"):
            upstream_body(CHAT, bad, True, max_n=8)
    with pytest.raises(CaptureError, match="one prompt"):
        upstream_body(COMPLETION, {"prompt": ["a", "b"]}, True)
    assert upstream_body(COMPLETION, {"prompt": [1, 2]}, True)["logprobs"] == 1
    with pytest.raises(CaptureError, match="include must be a list"):
        upstream_body(RESPONSES, {"include": "x"}, True)

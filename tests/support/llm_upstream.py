"""An inference server for the gateway tests that speaks the OpenAI API the way vLLM does:
with ``return_token_ids`` it returns ``prompt_token_ids`` (chat: top level; completions:
per choice; streams: first chunk) and per-choice ``token_ids`` (streams: per chunk); with
``return_tokens_as_token_ids`` log-prob tokens are ``token_id:<n>``. Token ids come from a
real tokenizer (a tokenizer.json), log-probs from a fixed function of position and id.
Every generation is appended to ``GET /_log`` so tests compare the store with the truth.

Behaviour: a chat whose last message is a tool result answers with it; a chat that offers
tools calls ``add`` on the two numbers in the last user message; anything else answers
"ok". ``n`` > 1 answers n different choices (choice i: the i-th of :data:`ANSWERS`).
``POST /v1/responses`` answers like vLLM's Responses API (``enable_response_messages``:
``input_messages``/``output_messages`` with token ids; ``include:
message.output_text.logprobs``). ``POST /_version`` sets the policy version every reply
names in ``X-Claw-Policy-Version`` (as an inference server a trainer updates would).
``model="fail"`` answers 500; the hostile models (:func:`hostile`) answer garbage,
huge, endless or never. Run: ``python -m tests.support.llm_upstream PORT TOKENIZER``.
With a third argument ``model``, chats are answered by a tiny randomly initialised GPT-2
(``tiny_model``: built from a config, seed 0, no download) sampling 8 tokens, and the
log-probs are the model's.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer

from orchestrator.gateway.capture import render_chat, response_messages

GARBAGE: list[bytes] = [
    b'{"choices": "garbage"}',
    b'{"choices": [1, null, "x"]}',
    b'{"choices": [{"message": 5, "logprobs": {"content": "no"}}]}',
    b'{"choices": [{"message": {"content": 7}, "logprobs": {"content": [{"logprob": "x"}]}}]}',
    b'{"choices": [{"token_ids": "abc", "logprobs": {"content": [[]]}}], "prompt_token_ids": 3}',
    b'{"choices": [{"token_ids": [1e300], "logprobs": {"content": [{"logprob": -1}]}}]}',
    b'{"prompt_token_ids": [-5], "choices": [{"token_ids": [%d], "logprobs": null}]}' % 2**70,
    b"[1, 2, 3]",
    b"null",
    b"not json at all \xff\xfe",
    b"",
    b'{"choices": [{"message": {"tool_calls": "x"}, "logprobs": {"content": []}}]}',
    b'data: {"choices": "garbage"}\n\ndata: [DONE]\n\n',
    b'data: {not json}\n\ndata: {"choices": [{"delta": 3}]}\n\ndata: [DONE]\n\n',
    b'data: [1]\n\ndata: {"choices": [{"delta": {}, "token_ids": "x"}]}\n\ndata: [DONE]\n\n',
]
"""200 replies that are not the OpenAI shape (``model="garbage:<i>"``)."""


def hostile(model: str, stream: bool) -> Response | None:
    """The reply of a hostile model name, or None for an ordinary one:
    ``garbage:<i>`` one of :data:`GARBAGE`; ``huge:<bytes>`` a 200 of that many bytes (a
    JSON body, or with ``stream`` an event stream that never sends ``[DONE]``);
    ``endless`` events until the client goes; ``hang`` no reply at all."""
    kind, _, arg = model.partition(":")
    if kind == "garbage":
        return Response(GARBAGE[int(arg) % len(GARBAGE)], 200, media_type="application/json")
    if kind == "huge":
        size, piece = int(arg), 1 << 20

        def body() -> Any:
            yield b"data: " if stream else b'{"pad": "'
            for k in range(0, size, piece):
                yield b"x" * min(piece, size - k)
            yield b"\n\n" if stream else b'"}'

        return StreamingResponse(body(), media_type="text/event-stream" if stream else None)
    if kind == "endless":

        async def events() -> Any:
            while True:
                yield b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
                await asyncio.sleep(0.001)

        return StreamingResponse(events(), media_type="text/event-stream")
    if kind == "hang":
        return StreamingResponse(_never(), media_type="application/json")
    return None


async def _never() -> Any:
    await asyncio.sleep(3600)
    yield b""


def logprob(pos: int, token_id: int, choice: int = 0) -> float:
    return -(((token_id * 31 + pos * 17 + choice * 101) % 997) / 250.0) - 0.001


ANSWERS = [
    "ok, done",
    "the sum is seven",
    "The answer is 7.",
    "ok, the answer is 42.",
    "What is 2 plus 2?",
    "Please add 5 and 9",
    "then tell me the answer",
    "The answer is 42.",
]
"""What choice i of a plain chat answers (choice 0: "ok, done", as with n = 1)."""


def tiny_model(vocab_size: int) -> Any:
    """A 2-layer GPT-2 with random weights: the same on every call (seed 0, CPU)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=512,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


class Upstream:
    def __init__(self, tokenizer_path: str, model: bool = False) -> None:
        self.tok = Tokenizer.from_file(tokenizer_path)
        self.log: list[dict[str, Any]] = []
        self.model = tiny_model(self.tok.get_vocab_size()) if model else None
        self.calls = 0
        self.version: int | None = None

    def sample(self, prompt_ids: list[int], n: int = 8) -> tuple[list[int], list[float]]:
        """n tokens sampled from the model, and each one's log-prob under it."""
        import torch

        gen = torch.Generator().manual_seed(self.calls)
        self.calls += 1
        ids: list[int] = []
        lps: list[float] = []
        with torch.no_grad():
            for _ in range(n):
                logits = self.model(torch.tensor([prompt_ids + ids])).logits[0, -1]
                logp = torch.log_softmax(logits.double(), -1)
                t = int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(t)
                lps.append(float(logp[t]))
        return ids, lps

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def piece(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def _reply(self, messages: list[dict[str, Any]], tools: Any) -> tuple[str, str | None, Any]:
        """(raw text the model emits, content, tool_calls)."""
        last = messages[-1]
        if last.get("role") == "tool":
            content = f"The answer is {last.get('content')}."
            return content, content, None
        if tools:
            a, b = (int(x) for x in re.findall(r"\d+", str(last.get("content")))[:2])
            args = json.dumps({"a": a, "b": b})
            call = {
                "id": f"call_{a}_{b}",
                "type": "function",
                "function": {"name": "add", "arguments": args},
            }
            raw = f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>'
            return raw, None, [call]
        return "ok, done", "ok, done", None

    def headers(self) -> dict[str, str]:
        return {} if self.version is None else {"x-claw-policy-version": str(self.version)}

    def _log(self, prompt_ids: list[int], ids: list[int], lps: list[float], **more: Any) -> None:
        self.log.append(
            {"prompt_ids": prompt_ids, "response_ids": ids, "logprobs": lps, **more}
            | ({} if self.version is None else {"version": self.version})
        )

    def _chat_n(self, body: dict[str, Any], prompt_ids: list[int], n: int) -> Response:
        """n choices of a plain chat, choice i answering ANSWERS[i % 8] (not streamed)."""
        choices = []
        want_ids = bool(body.get("return_token_ids"))
        for c in range(n):
            text = ANSWERS[c % len(ANSWERS)]
            ids = self.encode(text)
            lps = [logprob(i, t, c) for i, t in enumerate(ids)]
            self._log(prompt_ids, ids, lps, choice=c)
            tok = [
                f"token_id:{t}" if body.get("return_tokens_as_token_ids") else self.piece(t)
                for t in ids
            ]
            choice: dict[str, Any] = {
                "index": c,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": {
                    "content": [
                        {"token": tok[i], "logprob": lps[i], "bytes": None, "top_logprobs": []}
                        for i in range(len(ids))
                    ]
                },
            }
            if want_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        out: dict[str, Any] = {
            "id": "chatcmpl-sim",
            "created": int(time.time()),
            "model": body["model"],
            "object": "chat.completion",
            "choices": choices,
        }
        if want_ids:
            out["prompt_token_ids"] = prompt_ids
        return JSONResponse(out, headers=self.headers())

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        odd = hostile(str(body.get("model")), bool(body.get("stream")))
        if odd is not None:
            return odd
        if body.get("model") == "fail":
            return JSONResponse(
                {
                    "error": {
                        "message": "model overloaded",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                },
                500,
            )
        messages = body["messages"]
        prompt_ids = self.encode(render_chat(messages))
        n = int(body.get("n") or 1)
        if n > 1:
            return self._chat_n(body, prompt_ids, n)
        if self.model is not None:
            ids, lps = self.sample(prompt_ids)
            content, calls = self.tok.decode(ids), None
        else:
            raw, content, calls = self._reply(messages, body.get("tools"))
            ids = self.encode(raw)
            lps = [logprob(i, t) for i, t in enumerate(ids)]
        self._log(prompt_ids, ids, lps)
        want_ids = bool(body.get("return_token_ids"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))

        def entry(i: int) -> dict[str, Any]:
            tok = f"token_id:{ids[i]}" if as_ids else self.piece(ids[i])
            return {"token": tok, "logprob": lps[i], "bytes": None, "top_logprobs": []}

        head = {"id": "chatcmpl-sim", "created": int(time.time()), "model": body["model"]}
        finish = "tool_calls" if calls else "stop"
        if not body.get("stream"):
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": finish,
                "message": {"role": "assistant", "content": content, "tool_calls": calls or []},
                "logprobs": {"content": [entry(i) for i in range(len(ids))]}
                if body.get("logprobs")
                else None,
            }
            out = {
                **head,
                "object": "chat.completion",
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt_ids) + len(ids),
                },
            }
            if want_ids:
                choice["token_ids"] = ids
                out["prompt_token_ids"] = prompt_ids
            return JSONResponse(out, headers=self.headers())

        def events() -> Any:
            for i in range(len(ids)):
                delta: dict[str, Any] = {"content": self.piece(ids[i]) if content else ""}
                if i == 0:
                    delta["role"] = "assistant"
                c: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": None,
                    "logprobs": {"content": [entry(i)]},
                }
                if want_ids:
                    c["token_ids"] = [ids[i]]
                chunk = {**head, "object": "chat.completion.chunk", "choices": [c]}
                if want_ids and i == 0:
                    chunk["prompt_token_ids"] = prompt_ids
                yield f"data: {json.dumps(chunk)}\n\n"
            last: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": finish}
            if calls:  # tool calls parsed at the end, arguments in two pieces
                args = calls[0]["function"]["arguments"]
                last["delta"] = {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": calls[0]["id"],
                            "type": "function",
                            "function": {"name": "add", "arguments": args[:5]},
                        },
                    ]
                }
                mid = {**head, "object": "chat.completion.chunk", "choices": [last]}
                yield f"data: {json.dumps(mid)}\n\n"
                last = {
                    "index": 0,
                    "finish_reason": finish,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": args[5:]}}]},
                }
            yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [last]})}\n\n"  # noqa: E501
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=self.headers())

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        prompt_ids = self.encode(body["prompt"])
        n = int(body.get("n") or 1)
        texts = [" the sum is seven"] if n == 1 else [ANSWERS[c % len(ANSWERS)] for c in range(n)]
        want_ids = bool(body.get("return_token_ids"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        gen = []
        for c, text in enumerate(texts):
            ids = self.encode(text)
            lps = [logprob(i, t, c) for i, t in enumerate(ids)]
            self._log(prompt_ids, ids, lps, **({"choice": c} if n > 1 else {}))
            toks = [f"token_id:{t}" if as_ids else self.piece(t) for t in ids]
            gen.append((ids, lps, toks))
        head = {"id": "cmpl-sim", "created": int(time.time()), "model": body["model"]}

        def choice(c: int, sl: slice, first: bool, finish: str | None) -> dict[str, Any]:
            ids, lps, toks = gen[c]
            out: dict[str, Any] = {
                "index": c,
                "text": "".join(self.piece(t) for t in ids[sl]),
                "finish_reason": finish,
                "logprobs": {
                    "tokens": toks[sl],
                    "token_logprobs": lps[sl],
                    "top_logprobs": [{} for _ in toks[sl]],
                    "text_offset": [],
                },
            }
            if want_ids:
                out["token_ids"] = ids[sl]
                if first:
                    out["prompt_token_ids"] = prompt_ids
            return out

        if not body.get("stream"):
            return JSONResponse(
                {
                    **head,
                    "object": "text_completion",
                    "choices": [choice(c, slice(None), True, "stop") for c in range(n)],
                },
                headers=self.headers(),
            )

        def events() -> Any:
            longest = max(len(g[0]) for g in gen)
            for i in range(longest):  # choices interleaved, as vLLM streams them
                for c in range(n):
                    if i >= len(gen[c][0]):
                        continue
                    fin = "stop" if i == len(gen[c][0]) - 1 else None
                    chunk = {
                        **head,
                        "object": "text_completion",
                        "choices": [choice(c, slice(i, i + 1), i == 0, fin)],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=self.headers())

    async def responses(self, request: Request) -> Response:
        """vLLM's Responses API, one generation: the answer "ok, done" (or the tool result
        of the last input item, as a chat would)."""
        body = await request.json()
        messages = response_messages(body)
        prompt_text = render_chat(messages)
        prompt_ids = self.encode(prompt_text)
        raw, content, _ = self._reply(messages or [{"role": "user", "content": ""}], None)
        ids = self.encode(raw)
        lps = [logprob(i, t) for i, t in enumerate(ids)]
        self._log(prompt_ids, ids, lps)
        with_lps = "message.output_text.logprobs" in (body.get("include") or [])

        def entry(i: int) -> dict[str, Any]:
            return {"token": self.piece(ids[i]), "logprob": lps[i], "bytes": [], "top_logprobs": []}

        part: dict[str, Any] = {"type": "output_text", "text": content, "annotations": []}
        if with_lps:
            part["logprobs"] = [entry(i) for i in range(len(ids))]
        item = {
            "type": "message",
            "id": "msg_sim",
            "role": "assistant",
            "status": "completed",
            "content": [part],
        }
        out: dict[str, Any] = {
            "id": "resp_sim",
            "object": "response",
            "created_at": int(time.time()),
            "model": body.get("model"),
            "status": "completed",
            "output": [item],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "temperature": 1.0,
            "top_p": 1.0,
            "usage": {
                "input_tokens": len(prompt_ids),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(ids),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(prompt_ids) + len(ids),
            },
        }
        if body.get("enable_response_messages"):
            out["input_messages"] = [
                {"message": prompt_text, "tokens": prompt_ids, "type": "raw_message_tokens"}
            ]
            out["output_messages"] = [{"message": raw, "tokens": ids, "type": "raw_message_tokens"}]
        if not body.get("stream"):
            return JSONResponse(out, headers=self.headers())

        def events() -> Any:
            seq = 0

            def event(kind: str, **data: Any) -> str:
                nonlocal seq
                seq += 1
                payload = {"type": kind, "sequence_number": seq, **data}
                return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

            yield event("response.created", response={**out, "status": "in_progress", "output": []})
            for i in range(len(ids)):
                yield event(
                    "response.output_text.delta",
                    item_id="msg_sim",
                    output_index=0,
                    content_index=0,
                    delta=self.piece(ids[i]),
                    logprobs=[entry(i)] if with_lps else [],
                )
            yield event("response.completed", response=out)

        return StreamingResponse(events(), media_type="text/event-stream", headers=self.headers())

    async def set_version(self, request: Request) -> Response:
        v = (await request.json())["version"]
        self.version = None if v is None else int(v)
        return JSONResponse({"version": self.version})

    async def get_log(self, request: Request) -> Response:
        return JSONResponse(self.log)


def app(tokenizer_path: str, model: bool = False) -> Starlette:
    up = Upstream(tokenizer_path, model)
    return Starlette(
        routes=[
            Route("/v1/chat/completions", up.chat, methods=["POST"]),
            Route("/v1/completions", up.completions, methods=["POST"]),
            Route("/v1/responses", up.responses, methods=["POST"]),
            Route("/_log", up.get_log, methods=["GET"]),
            Route("/_version", up.set_version, methods=["POST"]),
        ]
    )


if __name__ == "__main__":
    import uvicorn

    served = app(sys.argv[2], model=sys.argv[3:] == ["model"])
    uvicorn.run(served, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")

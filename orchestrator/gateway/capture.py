"""What one OpenAI-compatible call produced, read off the request and the upstream's reply
(a JSON body, or the SSE stream of chunks): the token ids and log-probs vLLM returns when
asked (``return_token_ids``: ``prompt_token_ids`` and per-choice ``token_ids``;
``logprobs``; ``return_tokens_as_token_ids``: ``token_id:<n>`` token strings), or, where
it returns none, the ids a configured tokenizer gives (``retokenized``). Pure functions:
the recorder thread runs them after the response went out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

CHAT = "chat"
COMPLETION = "completion"
TOKEN_ID_PREFIX = "token_id:"


class CaptureError(ValueError):
    """The call cannot be recorded as a turn (the reason is its message)."""


@dataclass
class Turn:
    """One call as a step: ids and log-probs, and the chat context for ``info``."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    retokenized: bool = False
    messages: list[Any] | None = None
    tool_calls: list[Any] | None = None
    finish_reason: str | None = None
    model: str | None = None
    policy_version: int | None = None


def upstream_body(kind: str, body: dict[str, Any], vllm_options: bool) -> dict[str, Any]:
    """The request as sent upstream: log-probs asked for (the agent's own top_logprobs
    kept), and with ``vllm_options`` the token ids too. ``n`` above 1 is refused: one
    call is one turn of one trajectory."""
    if int(body.get("n") or 1) != 1:
        raise CaptureError("n must be 1 through the gateway (one call is one turn)")
    out = dict(body)
    if kind == CHAT:
        out["logprobs"] = True
    else:
        out["logprobs"] = max(int(body.get("logprobs") or 0), 1)
    if vllm_options:
        out["return_token_ids"] = True
        out["return_tokens_as_token_ids"] = True
    if body.get("stream"):
        opts = dict(body.get("stream_options") or {})
        opts.setdefault("include_usage", True)
        out["stream_options"] = opts
    return out


def _choice_logprobs(kind: str, logprobs: Mapping[str, Any] | None) -> tuple[list, list]:
    """(token strings, log-probs) of a choice's ``logprobs`` object."""
    if not logprobs:
        return [], []
    if kind == CHAT:
        content = logprobs.get("content") or []
        return [c.get("token") for c in content], [c.get("logprob") for c in content]
    return list(logprobs.get("tokens") or []), list(logprobs.get("token_logprobs") or [])


@dataclass
class _Acc:
    """A response being assembled (a JSON body is one chunk of a stream)."""

    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None
    tokens: list[Any] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    model: str | None = None

    def add(self, kind: str, obj: Mapping[str, Any], delta: bool) -> None:
        self.model = obj.get("model") or self.model
        if obj.get("prompt_token_ids") is not None:  # chat: top level
            self.prompt_ids = list(obj["prompt_token_ids"])
        for choice in obj.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids") is not None:  # completions: per choice
                self.prompt_ids = list(choice["prompt_token_ids"])
            if choice.get("token_ids") is not None:
                self.token_ids = (self.token_ids or []) + list(choice["token_ids"])
            toks, lps = _choice_logprobs(kind, choice.get("logprobs"))
            self.tokens += toks
            self.logprobs += lps
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            if kind == COMPLETION:
                self.text.append(choice.get("text") or "")
                continue
            msg = choice.get("delta" if delta else "message") or {}
            self.text.append(msg.get("content") or "")
            for i, call in enumerate(msg.get("tool_calls") or []):
                self._tool_call(call.get("index", i) if delta else i, call)

    def _tool_call(self, index: int, call: Mapping[str, Any]) -> None:
        """Stream deltas carry a call in pieces (arguments concatenated); a full body
        carries it whole. Both end in the same normalized form."""
        cur = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        cur["id"] = call.get("id") or cur["id"]
        cur["type"] = call.get("type") or cur["type"]
        fn = call.get("function") or {}
        cur["function"]["name"] += fn.get("name") or ""
        cur["function"]["arguments"] += fn.get("arguments") or ""


def read_body(kind: str, body: bytes) -> _Acc:
    acc = _Acc()
    acc.add(kind, _json(body, "upstream response"), delta=False)
    return acc


def read_stream(kind: str, raw: bytes) -> _Acc:
    """The SSE events of a streamed reply (``data: {...}`` lines, ``data: [DONE]``)."""
    acc = _Acc()
    for line in raw.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]" or not data:
            continue
        acc.add(kind, _json(data, "upstream stream event"), delta=True)
    return acc


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise CaptureError(f"{what} is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CaptureError(f"{what} is not a JSON object")
    return obj


class Retokenizer:
    """A Hugging Face tokenizer from a local ``tokenizer.json`` for upstreams that return
    no token ids. Chat prompts are rendered with ``CHAT_TEMPLATE`` (a ChatML layout; the
    ``tokenizers`` package has no chat templates), so such prompt ids approximate what the
    server saw: the step is marked ``retokenized``."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def response_ids(self, tokens: list[str], text: str) -> list[int]:
        """Ids of the response tokens, aligned with their log-probs: each token string
        encoded alone (one id each), else the whole text (when the count matches)."""
        ids = [self.encode(t) for t in tokens]
        if all(len(i) == 1 for i in ids):
            return [i[0] for i in ids]
        whole = self.encode(text)
        if len(whole) != len(tokens):
            raise CaptureError(
                f"retokenized response has {len(whole)} tokens, upstream gave "
                f"{len(tokens)} log-probs: cannot align them"
            )
        return whole


def render_chat(messages: list[Any]) -> str:
    """The ChatML text of chat messages plus the assistant header (retokenization only)."""
    parts = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if isinstance(m, dict) and m.get("tool_calls"):
            content = (content or "") + json.dumps(m["tool_calls"], separators=(",", ":"))
        role = m.get("role", "user") if isinstance(m, dict) else "user"
        parts.append(f"<|im_start|>{role}\n{content or ''}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def capture(
    kind: str,
    request: Mapping[str, Any],
    reply: bytes,
    streamed: bool,
    retokenizer: Retokenizer | None,
) -> Turn:
    """The turn one successful call produced. Raises CaptureError when it holds no
    log-probs, or lacks token ids and no tokenizer is configured."""
    acc = read_stream(kind, reply) if streamed else read_body(kind, reply)
    if not acc.logprobs or any(not isinstance(v, int | float) for v in acc.logprobs):
        raise CaptureError("the upstream returned no log-probs for the response")
    logprobs = [max(float(v), -1e30) for v in acc.logprobs]  # vLLM writes -inf as -9999.0
    text = "".join(acc.text)
    messages = list(request.get("messages") or []) if kind == CHAT else None
    response_ids = acc.token_ids
    if (
        response_ids is None
        and acc.tokens
        and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in acc.tokens)
    ):
        response_ids = [int(t[len(TOKEN_ID_PREFIX) :]) for t in acc.tokens]
    prompt_ids = acc.prompt_ids
    retokenized = response_ids is None or prompt_ids is None
    if retokenized:
        if retokenizer is None:
            raise CaptureError(
                "the upstream returned no token ids and no tokenizer is configured "
                "(claw gateway --tokenizer tokenizer.json)"
            )
        if response_ids is None:
            response_ids = retokenizer.response_ids(acc.tokens, text)
        if prompt_ids is None:
            prompt = request.get("prompt")
            if kind == CHAT:
                prompt = render_chat(messages or [])
            elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                prompt_ids = list(prompt)
            if prompt_ids is None:
                prompt_ids = retokenizer.encode(str(prompt or ""))
    if len(response_ids) != len(logprobs):
        raise CaptureError(f"{len(response_ids)} response token ids but {len(logprobs)} log-probs")
    return Turn(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_logprobs=logprobs,
        retokenized=retokenized,
        messages=messages,
        tool_calls=[acc.tool_calls[i] for i in sorted(acc.tool_calls)] or None,
        finish_reason=acc.finish_reason,
        model=acc.model,
    )

"""What one OpenAI-compatible call produced, read off the request and the upstream's reply
(a JSON body, or the SSE stream of chunks): the token ids and log-probs vLLM returns when
asked (``return_token_ids``: ``prompt_token_ids`` and per-choice ``token_ids``;
``logprobs``; ``return_tokens_as_token_ids``: ``token_id:<n>`` token strings), or, where
it returns none, the ids a configured tokenizer gives (``retokenized``); one turn per
choice of a call with n > 1 (streamed choices may interleave), and a Responses API reply's
one generation from vLLM's ``input_messages``/``output_messages`` token ids. Pure
functions: the recorder thread runs them after the response went out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

CHAT = "chat"
COMPLETION = "completion"
RESPONSES = "response"
TOKEN_ID_PREFIX = "token_id:"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""What a Responses API request includes to get the output text's log-probs."""


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


def upstream_body(
    kind: str, body: dict[str, Any], vllm_options: bool, max_n: int = 1
) -> dict[str, Any]:
    """The request as sent upstream: log-probs asked for (the agent's own top_logprobs
    kept), and with ``vllm_options`` the token ids too. ``n`` may be 1..``max_n``; a call
    with n > 1 is recorded as n trajectories of one group (docs/llm.md). A completions
    call takes one prompt (a string or one list of token ids): a batch of prompts would be
    several turns of several trajectories in one reply."""
    n = body.get("n")
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
        raise CaptureError(
            f"n must be an integer from 1 to {max_n} through the gateway "
            "(claw gateway --max-n; n > 1 records n trajectories of one group)"
        )
    if kind == COMPLETION:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            raise CaptureError(
                "prompt must be one prompt (a string or a list of token ids): one call is "
                "one turn of one trajectory (n > 1 for several samples of it)"
            )
    out = dict(body)
    if kind == RESPONSES:
        include = body.get("include") or []
        if not isinstance(include, list):
            raise CaptureError("include must be a list")
        if LOGPROBS_INCLUDE not in include:
            out["include"] = [*include, LOGPROBS_INCLUDE]
        out["top_logprobs"] = body.get("top_logprobs") or 0
        if vllm_options:
            out["enable_response_messages"] = True
        return out
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


def _numbers(values: list[Any]) -> bool:
    """Log-probs as an upstream must give them: a non-empty list of JSON numbers (a
    ``true`` is not 1.0)."""
    return bool(values) and all(
        not isinstance(v, bool) and isinstance(v, int | float) for v in values
    )


def _choice_logprobs(kind: str, logprobs: Mapping[str, Any] | None) -> tuple[list, list]:
    """(token strings, log-probs) of a choice's ``logprobs`` object."""
    if not logprobs:
        return [], []
    if kind == CHAT:
        content = logprobs.get("content") or []
        return [c.get("token") for c in content], [c.get("logprob") for c in content]
    return list(logprobs.get("tokens") or []), list(logprobs.get("token_logprobs") or [])


@dataclass
class _Choice:
    """One choice of a response being assembled (a JSON body is one chunk of a stream)."""

    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None
    tokens: list[Any] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None

    def add(self, kind: str, choice: Mapping[str, Any], delta: bool) -> None:
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
            return
        msg = choice.get("delta" if delta else "message") or {}
        self.text.append(msg.get("content") or "")
        for i, call in enumerate(msg.get("tool_calls") or []):
            self.tool_call(call.get("index", i) if delta else i, call)

    def tool_call(self, index: int, call: Mapping[str, Any]) -> None:
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


@dataclass
class _Acc:
    """A reply being assembled: the call's prompt ids (chat: top level) and its choices."""

    prompt_ids: list[int] | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    model: str | None = None

    def add(self, kind: str, obj: Mapping[str, Any], delta: bool) -> None:
        self.model = obj.get("model") or self.model
        if obj.get("prompt_token_ids") is not None:  # chat: top level
            self.prompt_ids = list(obj["prompt_token_ids"])
        for choice in obj.get("choices") or []:
            index = choice.get("index", 0)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 4096:
                raise CaptureError(f"choice index {str(index)[:20]!r} is not a small integer")
            self.choices.setdefault(index, _Choice()).add(kind, choice, delta)


def read_body(kind: str, body: bytes) -> _Acc:
    acc = _Acc()
    acc.add(kind, _json(body, "upstream response"), delta=False)
    return acc


def read_stream(kind: str, raw: bytes) -> _Acc:
    """The SSE events of a streamed reply (``data: {...}`` lines, ``data: [DONE]``)."""
    acc = _Acc()
    for data in _events(raw):
        acc.add(kind, _json(data, "upstream stream event"), delta=True)
    return acc


def _events(raw: bytes) -> list[bytes]:
    out = []
    for line in raw.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]" or not data:
            continue
        out.append(data)
    return out


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
    """The turn of choice 0 of one successful call (:func:`capture_all` has every
    choice's)."""
    return capture_all(kind, request, reply, streamed, retokenizer, n=1)[0]


def capture_all(
    kind: str,
    request: Mapping[str, Any],
    reply: bytes,
    streamed: bool,
    retokenizer: Retokenizer | None,
    n: int = 1,
) -> list[Turn]:
    """The turns of choices 0..n-1 of one successful call. Raises CaptureError when a
    choice is missing, holds no log-probs, or lacks token ids and no tokenizer is
    configured: a call is recorded whole or not at all."""
    if kind == RESPONSES:
        return [_response_turn(request, reply, streamed, retokenizer)]
    acc = read_stream(kind, reply) if streamed else read_body(kind, reply)
    messages = list(request.get("messages") or []) if kind == CHAT else None
    turns = []
    for i in range(n):
        choice = acc.choices.get(i)
        if choice is None:
            raise CaptureError(f"the upstream's reply has no choice {i} (n={n})")
        turns.append(_turn(kind, request, acc, choice, messages, retokenizer))
    return turns


def _required(retokenizer: Retokenizer | None) -> Retokenizer:
    """The tokenizer a reply without token ids is re-tokenized with; raises when none is
    configured."""
    if retokenizer is None:
        raise CaptureError(
            "the upstream returned no token ids and no tokenizer is configured "
            "(claw gateway --tokenizer tokenizer.json)"
        )
    return retokenizer


def _turn(
    kind: str,
    request: Mapping[str, Any],
    acc: _Acc,
    choice: _Choice,
    messages: list[Any] | None,
    retokenizer: Retokenizer | None,
) -> Turn:
    if not _numbers(choice.logprobs):
        raise CaptureError("the upstream returned no log-probs for the response")
    logprobs = [max(float(v), -1e30) for v in choice.logprobs]  # vLLM writes -inf as -9999.0
    text = "".join(choice.text)
    response_ids = choice.token_ids
    if (
        response_ids is None
        and choice.tokens
        and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in choice.tokens)
    ):
        response_ids = [int(t[len(TOKEN_ID_PREFIX) :]) for t in choice.tokens]
    prompt_ids = choice.prompt_ids if choice.prompt_ids is not None else acc.prompt_ids
    retokenized = response_ids is None or prompt_ids is None
    if retokenized:
        retokenizer = _required(retokenizer)
        if response_ids is None:
            response_ids = retokenizer.response_ids(choice.tokens, text)
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
        tool_calls=[choice.tool_calls[i] for i in sorted(choice.tool_calls)] or None,
        finish_reason=choice.finish_reason,
        model=acc.model,
    )


def response_messages(request: Mapping[str, Any]) -> list[Any]:
    """A Responses API request's input as chat messages: ``instructions`` as the system
    message, a string ``input`` as one user message, input items as they are."""
    out: list[Any] = []
    if isinstance(request.get("instructions"), str):
        out.append({"role": "system", "content": request["instructions"]})
    given = request.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
    elif isinstance(given, list):
        out += given
    return out


def _response_turn(
    request: Mapping[str, Any], reply: bytes, streamed: bool, retokenizer: Retokenizer | None
) -> Turn:
    """A Responses API reply (vLLM's): the prompt and output ids from
    ``input_messages``/``output_messages`` (``enable_response_messages``), the log-probs
    from the output text parts (``include: message.output_text.logprobs``). A stream is
    read from its final ``response.completed`` event, which carries the whole response."""
    if streamed:
        body = None
        for data in _events(reply):
            event = _json(data, "upstream stream event")
            if event.get("type") in ("response.completed", "response.incomplete"):
                body = event.get("response")
        if not isinstance(body, dict):
            raise CaptureError("the response stream has no response.completed event")
    else:
        body = _json(reply, "upstream response")
    tokens, logprobs, text, calls = [], [], [], []
    for item in body.get("output") or []:
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if part.get("type") != "output_text":
                    continue
                text.append(part.get("text") or "")
                for e in part.get("logprobs") or []:
                    tokens.append(e.get("token"))
                    logprobs.append(e.get("logprob"))
        elif item.get("type") == "function_call":
            calls.append(
                {
                    "id": item.get("call_id") or item.get("id"),
                    "type": "function",
                    "function": {
                        "name": item.get("name") or "",
                        "arguments": item.get("arguments") or "",
                    },
                }
            )
    if not _numbers(logprobs):
        raise CaptureError("the upstream returned no log-probs for the response")

    def ids_of(what: str) -> list[int] | None:
        found = body.get(what)
        if found is None:
            return None
        if not isinstance(found, list) or len(found) != 1 or not isinstance(found[0], dict):
            raise CaptureError(
                f"{what}: one generation per recorded response (the reply holds "
                f"{len(found) if isinstance(found, list) else 'no list of'} messages)"
            )
        return list(found[0].get("tokens") or [])

    prompt_ids, response_ids = ids_of("input_messages"), ids_of("output_messages")
    retokenized = prompt_ids is None or response_ids is None
    messages = response_messages(request)
    if retokenized:
        retokenizer = _required(retokenizer)
        if response_ids is None:
            response_ids = retokenizer.response_ids(tokens, "".join(text))
        if prompt_ids is None:
            prompt_ids = retokenizer.encode(render_chat(messages))
    if len(response_ids) != len(logprobs):
        raise CaptureError(
            f"{len(response_ids)} response token ids but {len(logprobs)} log-probs (a "
            "response with tool calls or reasoning carries log-probs of its text only)"
        )
    return Turn(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_logprobs=[max(float(v), -1e30) for v in logprobs],
        retokenized=retokenized,
        messages=messages,
        tool_calls=calls or None,
        finish_reason=body.get("status"),
        model=body.get("model"),
    )

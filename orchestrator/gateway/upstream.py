"""The gateway's HTTP/1.1 client for its upstream: keep-alive connections over asyncio
streams, replies parsed by httptools (the C parser uvicorn uses). It does the one thing
the gateway needs — POST a body, read the status and headers, then the body whole or as
it arrives — in a fraction of httpx's CPU per call (docs/benchmarks.md, "Capture
gateway"): that CPU is most of what the gateway adds to an agent's latency."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import SplitResult, urlsplit

import httptools


class UpstreamError(Exception):
    """The upstream could not be reached, or broke its reply off (the message says how)."""


class _Parser:
    """httptools callbacks: the reply's status, headers and body pieces."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.received = 0  # body bytes so far
        self.headers_done = False
        self.keep_alive = False
        self.done = False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()  # (False once the reply is read)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.received += len(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class Reply:
    """One upstream reply: ``status`` and ``headers`` (lower-case names) once the headers
    arrived; the body by :meth:`read` or :meth:`chunks`. :meth:`close` hands a fully read
    connection back to the pool (else closes it)."""

    def __init__(self, pool: Upstream, conn: _Conn, state: _Parser, parser: object) -> None:
        self._pool, self._conn, self._state, self._parser = pool, conn, state, parser
        self.status: int = parser.get_status_code()  # type: ignore[attr-defined]  # httptools' parser has no stubs
        self.headers = state.headers
        self._keep = state.keep_alive

    async def _more(self) -> bool:
        """Feed the parser the next bytes; False at the end of the reply."""
        if self._state.done:
            return False
        try:
            async with asyncio.timeout(self._pool.timeout):
                data = await self._conn.reader.read(65536)
        except (OSError, TimeoutError) as e:
            self._keep = False
            raise UpstreamError(f"reading the reply: {type(e).__name__}: {e}") from None
        if not data:
            if "content-length" in self.headers or "chunked" in self.headers.get(
                "transfer-encoding", ""
            ):
                raise UpstreamError("the upstream closed the connection mid-reply")
            self._state.done = True  # a body delimited by the connection's end
            self._keep = False
            return False
        try:
            self._parser.feed_data(data)  # type: ignore[attr-defined]  # httptools' parser has no stubs
        except httptools.HttpParserError as e:
            raise UpstreamError(f"the upstream's reply is not HTTP: {e}") from None
        return True

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked)."""
        while True:
            if self._state.body:
                pieces, self._state.body = self._state.body, []
                for p in pieces:
                    yield p
            if not await self._more() and not self._state.body:
                return

    async def read(self) -> bytes:
        while await self._more():
            pass
        body = b"".join(self._state.body)
        self._state.body = []
        return body

    async def read_upto(self, limit: int) -> tuple[list[bytes], bool]:
        """``(pieces, True)``: the whole body, at most ``limit`` bytes; else ``(pieces read
        so far, False)`` once past it (none, if the declared length is over it) and
        :meth:`chunks` gives the rest: a reply is never held whole past ``limit``."""
        declared = self.headers.get("content-length", "")
        if not (declared.isdigit() and int(declared) > limit):
            while self._state.received <= limit and await self._more():
                pass
        pieces, self._state.body = self._state.body, []
        return pieces, self._state.done and self._state.received <= limit

    async def close(self) -> None:
        self._pool._release(self._conn, self._state.done and self._keep)


def check_base_url(base_url: str) -> SplitResult:
    """``base_url`` split, when it is an ``http(s)://host[:port]`` URL; else ``ValueError``."""
    try:
        u = urlsplit(base_url.rstrip("/"))
        u.port  # noqa: B018 (a port out of range or not a number raises here)
    except ValueError as e:
        raise ValueError(f"upstream {base_url[:200]!r}: {e}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"upstream {base_url[:200]!r}: give an http:// or https:// URL")
    return u


class Upstream:
    """A pool of keep-alive connections to one ``http(s)://host:port`` base URL."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str] | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_idle: int = 200,
    ) -> None:
        u = check_base_url(base_url)
        self.host, self.prefix = u.hostname, u.path
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        host_header = u.netloc.rpartition("@")[2]
        fixed = {"host": host_header, "connection": "keep-alive", **(headers or {})}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self.timeout, self.connect_timeout, self.max_idle = timeout, connect_timeout, max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
        except (OSError, TimeoutError) as e:
            raise UpstreamError(f"cannot connect: {type(e).__name__}: {e}") from None
        return _Conn(reader, writer)

    def _release(self, conn: _Conn, keep: bool) -> None:
        if keep and len(self._idle) < self.max_idle and not conn.writer.is_closing():
            self._idle.append(conn)
        else:
            conn.close()

    async def post(self, path: str, body: bytes, content_type: str) -> Reply:
        """Send ``body`` and wait for the reply's headers. A reused connection the server
        closed while idle (no byte of a reply read) is retried once on a new one (never on
        another idle one: after a lull the server closes them all)."""
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n"
        ).encode("latin-1")
        for attempt in (0, 1):
            # the retry takes a new connection: after a lull the server's keep-alive
            # timeout may have closed every idle one at once
            reused = bool(self._idle) and not attempt
            conn = self._idle.pop() if reused else await self._connect()
            try:
                conn.writer.write(head + self._fixed + b"\r\n" + body)
                return await self._headers(conn)
            except _Stale:
                conn.close()
                if not reused or attempt:
                    raise UpstreamError("the upstream closed the connection") from None
            except (OSError, TimeoutError, UpstreamError) as e:
                conn.close()
                if isinstance(e, UpstreamError):
                    raise
                if reused and not attempt and isinstance(e, ConnectionError):
                    continue
                raise UpstreamError(f"{type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    async def _headers(self, conn: _Conn) -> Reply:
        state = _Parser()
        parser = state.parser
        got = False
        while not state.headers_done:
            async with asyncio.timeout(self.timeout):
                data = await conn.reader.read(65536)
            if not data:
                if not got:
                    raise _Stale
                raise UpstreamError("the upstream closed the connection mid-reply")
            got = True
            try:
                parser.feed_data(data)
            except httptools.HttpParserError as e:
                raise UpstreamError(f"the upstream's reply is not HTTP: {e}") from None
        return Reply(self, conn, state, parser)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _Stale(Exception):
    """A reused connection ended before any byte of a reply."""

"""The gateway's Redis client for the response path: RESP over asyncio streams, replies
parsed by hiredis, a pool of connections each carrying one command at a time. The gate's
one script call per new trajectory is most of what admission adds to a first call's
latency, and redis-py's asyncio client spends about four times this one's CPU (and twice
its wall time, on a loaded machine) on a round trip (docs/benchmarks.md, "Capture
gateway"), as httpx did against ``upstream.py``. Plain ``redis://`` URLs only (user,
password and database from the URL); :func:`connect` answers None for the others (TLS, a
cluster, a socket), and the gate keeps redis-py's client for those."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
from redis.exceptions import RedisError


class RespError(RedisError):
    """Redis answered an error (its message), or the connection failed."""


def _pack(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parser = hiredis.Reader()

    async def call(self, payload: bytes) -> Any:
        self.writer.write(payload)
        while True:
            reply = self.parser.gets()
            if reply is not False:
                return reply
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError("Redis closed the connection")
            self.parser.feed(data)


class RespClient:
    """``await client.call("EVALSHA", ...)``: one command, its reply (bytes, ints, lists;
    a Redis error raises :class:`RespError`). Connections are reused; one that failed or
    timed out is closed."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        password: str | None = None,
        username: str | None = None,
        db: int = 0,
        timeout: float = 2.0,
        max_idle: int = 64,
    ) -> None:
        self.host, self.port = host, port
        self.username, self.password, self.db = username, password, db
        self.timeout, self.max_idle = timeout, max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = _Conn(reader, writer)
        if self.password is not None:
            user = (self.username,) if self.username else ()
            self._check(await conn.call(_pack(("AUTH", *user, self.password))))
        if self.db:
            self._check(await conn.call(_pack(("SELECT", self.db))))
        return conn

    @staticmethod
    def _check(reply: Any) -> Any:
        if isinstance(reply, hiredis.ReplyError):
            raise RespError(str(reply))
        return reply

    async def call(self, *args: Any) -> Any:
        conn = None
        try:
            async with asyncio.timeout(self.timeout):
                conn = self._idle.pop() if self._idle else await self._connect()
                reply = await conn.call(_pack(args))
        except BaseException as e:  # cancelled too: a reply may still be on its way
            if conn is not None:
                conn.writer.close()
            if isinstance(e, OSError | TimeoutError):
                raise RespError(f"{type(e).__name__}: {e}") from None
            raise
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.writer.close()
        return self._check(reply)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.writer.close()


def connect(url: str, timeout: float) -> RespClient | None:
    """A client of a plain ``redis://host:port[/db]`` URL (credentials in it), else None."""
    u = urlsplit(url)
    if u.scheme != "redis" or not u.hostname or u.query or "," in u.netloc:
        return None
    path = u.path.strip("/")
    if path and not path.isdigit():
        return None
    return RespClient(
        u.hostname,
        u.port or 6379,
        password=unquote(u.password) if u.password is not None else None,
        username=unquote(u.username) if u.username else None,
        db=int(path or 0),
        timeout=timeout,
    )

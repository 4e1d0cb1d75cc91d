"""Commands packed as RESP by hand: the one transport for the paths where redis-py's
per-command cost shows (docs/benchmarks.md).

Through redis-py (with hiredis) each reply is read into the parser's buffer, copied into a
``bytes`` object, viewed row by row and copied again into batch order, and each command
costs ~5 µs to queue and pack: for the ~260 GETRANGEs of a 256-step image batch (10.8 MB)
that is about half of a fetch's CPU time. Here commands are packed in one pass and every
GETRANGE reply's body is received into its place in one buffer.

- :class:`Batch` and :class:`Transport`: a read path's round trip. A batch is commands,
  each queued with its own decoder (GETRANGEs whose replies fill one buffer, then any
  other command, whose replies hiredis parses); a transport sends it on a connection of
  its own (:class:`BulkReader`), or through a redis-py pipeline where that cannot speak to
  the server (TLS, Cluster, a credential provider, RESP3) or another thread is using it.
- :func:`setrange_many`: large SETRANGEs sent straight from their memory (ingest).
- :class:`RespClient`: commands over asyncio streams (the capture gateway's response path,
  where redis-py's asyncio client spends about four times its CPU on a round trip).

The own connections speak plain TCP and Unix sockets with the client's password, user and
database; for anything else they are not made and redis-py carries the commands.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import hiredis
import numpy as np
import redis
from redis.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from claw_tasks.connection.client import Client, is_cluster

_CHUNK = 1 << 16


def pack(args: Sequence[Any]) -> bytes:
    """One command in RESP (bytes as they are, anything else as its ``str``)."""
    return b"*%d\r\n" % len(args) + pack_args(args)


def pack_args(args: Sequence[Any]) -> bytes:
    """Arguments of a command in RESP, without the command's header (``*<count>``): a
    command's constant part, packed once."""
    parts = []
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def _pack_getranges(commands: Sequence[tuple[str, int, int]]) -> bytes:
    out = []
    for key, start, end in commands:
        k, a, b = key.encode(), b"%d" % start, b"%d" % end
        out.append(
            b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
            % (len(k), k, len(a), a, len(b), b)
        )
    return b"".join(out)


class Packed(NamedTuple):
    """A command packed already (``blob``: a caller that sends the same arguments often
    packs their constant part once) and its arguments (``args``: for redis-py)."""

    blob: bytes
    args: Sequence[Any]


Command = Sequence[Any] | Packed


class Reply:
    """What a queued command's decoder made of its reply, once the batch ran."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


def _same(reply: Any) -> Any:
    return reply


class Batch:
    """Commands for one round trip, each with its decoder: no caller counts reply
    positions. GETRANGEs queued by :meth:`into` go first (their replies land in one
    buffer), the commands of :meth:`add` and :meth:`add_all` after them, in order."""

    def __init__(self) -> None:
        self.ranges: list[tuple[str, int, int]] = []
        self.commands: list[Command] = []
        self._into: list[tuple[int, Callable[[np.ndarray], Any], Reply]] = []
        self._add: list[tuple[int, Callable[[Any], Any], Reply]] = []

    def into(
        self, ranges: Sequence[tuple[str, int, int]], decode: Callable[[np.ndarray], Any]
    ) -> Reply:
        """``GETRANGE key start end`` of each of ``ranges``; ``decode`` gets their bytes
        concatenated (uint8; a reply shorter than its range, from a key not written yet,
        padded with zeros)."""
        self.ranges += ranges
        reply = Reply()
        self._into.append((sum(end - start + 1 for _, start, end in ranges), decode, reply))
        return reply

    def add(self, command: Command, decode: Callable[[Any], Any] = _same) -> Reply:
        """One command; ``decode`` gets its reply."""
        return self.add_all([command], lambda replies: decode(replies[0]))

    def add_all(self, commands: Sequence[Command], decode: Callable[[list[Any]], Any]) -> Reply:
        """Several commands; ``decode`` gets the list of their replies."""
        self.commands += commands
        reply = Reply()
        self._add.append((len(commands), decode, reply))
        return reply

    def nbytes(self) -> int:
        """Bytes the GETRANGEs read."""
        return sum(n for n, _, _ in self._into)

    def decode(self, buf: np.ndarray, replies: Sequence[Any]) -> None:
        """Hand each decoder its part of the replies: ``buf`` for the GETRANGEs, then
        ``replies`` for the other commands."""
        at = 0
        for n, decode, reply in self._into:
            reply.value = decode(buf[at : at + n])
            at += n
        at = 0
        for n, decode, reply in self._add:
            reply.value = decode(replies[at : at + n])
            at += n


class Transport:
    """Runs batches of read-only commands on ``client``'s server, each in one round trip;
    ``scripts`` (objects with the ``source`` of a Lua script its commands ``EVALSHA``) are
    loaded on NOSCRIPT and the batch sent again. Safe to share between threads and across
    a fork: a thread that finds the own connection busy, or a forked child, uses redis-py
    or a connection of its own."""

    def __init__(self, client: Client, scripts: Sequence[Any] = ()) -> None:
        self.client, self.scripts = client, list(scripts)
        self._own: tuple[int, BulkReader | None] | None = None
        self.lock = threading.Lock()
        """Held while a batch is on the own connection."""

    def run(self, batch: Batch) -> None:
        """Send ``batch`` and set each of its replies (a Redis error raises, after every
        reply was read)."""
        reader = self.reader()
        if reader is not None and self.lock.acquire(blocking=False):
            try:
                buf = np.empty(batch.nbytes(), np.uint8)
                cs = batch.commands
                blob = b"".join(c.blob if isinstance(c, Packed) else pack(c) for c in cs)
                try:
                    replies = reader.run(batch.ranges, memoryview(buf), blob, len(cs))
                except NoScriptError:
                    self._load()
                    replies = reader.run(batch.ranges, memoryview(buf), blob, len(cs))
            finally:
                self.lock.release()
        else:
            try:
                buf, replies = self._pipeline(batch)
            except NoScriptError:
                self._load()
                buf, replies = self._pipeline(batch)
        batch.decode(buf, replies)

    def reader(self) -> BulkReader | None:
        """The own connection (made again in a forked child: a socket is not shared across
        processes); None where it cannot speak to the server."""
        if self._own is None or self._own[0] != os.getpid():
            if self._own is not None:  # a forked child: the lock may be held by no thread
                self.lock = threading.Lock()
            self._own = (os.getpid(), BulkReader.for_client(self.client))
        return self._own[1]

    def _load(self) -> None:
        for script in self.scripts:
            self.client.script_load(script.source)

    def _pipeline(self, batch: Batch) -> tuple[np.ndarray, list[Any]]:
        with self.client.pipeline(transaction=False) as pipe:
            for key, start, end in batch.ranges:
                pipe.getrange(key, start, end)
            for c in batch.commands:
                pipe.execute_command(*(c.args if isinstance(c, Packed) else c))
            replies = pipe.execute()
        buf = np.zeros(batch.nbytes(), np.uint8)
        at = 0
        for (_, start, end), raw in zip(batch.ranges, replies, strict=False):
            buf[at : at + len(raw)] = np.frombuffer(raw, np.uint8)
            at += end - start + 1
        return buf, replies[len(batch.ranges) :]


class BulkReader:
    """One plain connection; not thread-safe (:class:`Transport` holds it under a lock)."""

    def __init__(self, kwargs: dict[str, Any], unix: bool) -> None:
        self.kwargs, self.unix = kwargs, unix
        self.sock: socket.socket | None = None
        self.buf = bytearray(_CHUNK)
        self.mv = memoryview(self.buf)
        self.start = self.end = 0  # unread bytes: buf[start:end]

    @classmethod
    def for_client(cls, client: Any) -> BulkReader | None:
        """A reader for the same server and database as ``client``; None when its
        connection is not a plain TCP or Unix socket speaking RESP2."""
        if not isinstance(client, redis.Redis):
            return None
        pool = client.connection_pool
        kw = pool.connection_kwargs
        if pool.connection_class not in (Connection, UnixDomainSocketConnection):
            return None
        if kw.get("credential_provider") or kw.get("protocol") not in (None, 2, "2"):
            return None
        return cls(dict(kw), pool.connection_class is UnixDomainSocketConnection)

    def getranges(self, commands: Sequence[tuple[str, int, int]], out: memoryview) -> None:
        """``GETRANGE key start end`` for each command, in one round trip; the replies fill
        ``out`` in order (a reply shorter than its range, from a key not written yet, is
        padded with zeros)."""
        self.run(commands, out, b"", 0)

    def run(
        self, ranges: Sequence[tuple[str, int, int]], out: memoryview, tail: bytes, n: int
    ) -> list[Any]:
        """In one round trip: the GETRANGEs ``ranges`` into ``out`` (as :meth:`getranges`),
        then the ``n`` commands packed in ``tail``, whose replies come back as hiredis
        parses them (errors as exceptions: NOSCRIPT as redis-py's :class:`NoScriptError`,
        raised once every reply is read). Any error closes the connection (the next call
        opens another); one found broken (the server restarted since) is replaced once at
        once (reads only: safe to send again)."""
        blob = _pack_getranges(ranges) + tail
        if self.sock is not None:
            try:
                return self._run_all(blob, ranges, out, n)
            except (OSError, redis.ConnectionError):
                self.close()
        return self._run_all(blob, ranges, out, n)

    def _run_all(
        self, blob: bytes, ranges: Sequence[tuple[str, int, int]], out: memoryview, n: int
    ) -> list[Any]:
        try:
            self._run(blob, ranges, out)
            replies = self._tail(n)
        except BaseException:
            self.close()
            raise
        for reply in replies:
            if isinstance(reply, hiredis.ReplyError):
                text = str(reply)
                raise (NoScriptError if text.startswith("NOSCRIPT") else redis.ResponseError)(text)
        return replies

    def _tail(self, n: int) -> list[Any]:
        """The next ``n`` replies, parsed by hiredis (bytes, ints, lists, errors)."""
        reader = hiredis.Reader()
        if self.end > self.start:
            reader.feed(bytes(self.mv[self.start : self.end]))
        self.start = self.end = 0
        replies: list[Any] = []
        while len(replies) < n:
            reply = reader.gets()
            if reply is False:
                got = self.sock.recv_into(self.mv)  # type: ignore[union-attr]
                if not got:
                    raise redis.ConnectionError("connection closed by the server")
                reader.feed(bytes(self.mv[:got]))
                continue
            replies.append(reply)
        if reader.has_data():
            raise redis.ResponseError("more replies than commands")
        return replies

    def _run(self, blob: bytes, commands: Sequence[tuple[str, int, int]], out: memoryview) -> None:
        sock = self.sock or self._connect()
        sock.sendall(blob)
        pos = 0
        for _, start, end in commands:
            want = end - start + 1
            n = self._bulk_header()
            if n > want:
                raise redis.ResponseError(f"GETRANGE returned {n} bytes, asked {want}")
            self._body_into(out[pos : pos + n])
            out[pos + n : pos + want] = bytes(want - n)
            pos += want
            self._expect(b"\r\n")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.start, self.end = None, 0, 0

    def _connect(self) -> socket.socket:
        kw = self.kwargs
        timeout = kw.get("socket_timeout")
        if self.unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(kw.get("socket_connect_timeout") or timeout)
            sock.connect(kw["path"])
        else:
            addr = (kw.get("host", "localhost"), int(kw.get("port", 6379)))
            sock = socket.create_connection(addr, kw.get("socket_connect_timeout") or timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        self.sock = sock
        setup = _setup(kw.get("username"), kw.get("password"), kw.get("db"))
        if setup:
            sock.sendall(b"".join(pack(args) for args in setup))
            for _ in setup:
                self._line()
        return sock

    def _fill(self) -> None:
        """Read more bytes after the unread ones (moved to the front first)."""
        if self.start:
            rest = self.end - self.start
            self.buf[:rest] = self.buf[self.start : self.end]
            self.start, self.end = 0, rest
        got = self.sock.recv_into(self.mv[self.end :])  # type: ignore[union-attr]
        if not got:
            raise redis.ConnectionError("connection closed by the server")
        self.end += got

    def _line(self) -> bytes:
        """The next reply line (a simple reply or a header); raises on an error reply."""
        while (i := self.buf.find(b"\r\n", self.start, self.end)) < 0:
            self._fill()
        line = bytes(self.buf[self.start : i])
        self.start = i + 2
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        return line

    def _bulk_header(self) -> int:
        line = self._line()
        if line[:1] != b"$":
            raise redis.ResponseError(f"expected a bulk reply, got {line[:40]!r}")
        return max(int(line[1:]), 0)

    def _body_into(self, dest: memoryview) -> None:
        have = min(len(dest), self.end - self.start)
        dest[:have] = self.mv[self.start : self.start + have]
        self.start += have
        while have < len(dest):  # the rest straight from the socket
            got = self.sock.recv_into(dest[have:])  # type: ignore[union-attr]
            if not got:
                raise redis.ConnectionError("connection closed by the server")
            have += got

    def _expect(self, text: bytes) -> None:
        while self.end - self.start < len(text):
            self._fill()
        if self.buf[self.start : self.start + len(text)] != text:
            raise redis.ResponseError("malformed reply")
        self.start += len(text)


def _setup(username: str | None, password: str | None, db: int | None) -> list[list[Any]]:
    """The commands a new connection sends first: AUTH, SELECT."""
    setup: list[list[Any]] = []
    if password is not None:
        setup.append(["AUTH", *([username] if username else []), password])
    if db:
        setup.append(["SELECT", db])
    return setup


def setrange_many(client: Client, writes: list[tuple[str, int, memoryview]]) -> None:
    """Pipelined ``SETRANGE key offset value`` of large values, sent straight from their
    memory. redis-py's packer copies each value twice (``bytes(memoryview)``, then into
    hiredis' packed command): at image rates that is as much CPU as the send itself
    (docs/benchmarks.md, "Ingest"). Here only each command's header is built; the values
    go to the socket as they are. On a cluster, writes to one slot (a shard's keys) go so
    to the slot's master; if the slot moved meanwhile (or the node is away), they are
    written again through redis-py's pipeline, which follows the move (``SETRANGE`` is
    idempotent)."""
    if not writes:
        return
    if not is_cluster(client):
        _send_setranges(client, writes)
        return
    if len({client.keyslot(key) for key, _, _ in writes}) == 1:
        try:
            node = client.get_node_from_key(writes[0][0])
            _send_setranges(client.get_redis_connection(node), writes)
            return
        except redis.ResponseError as e:
            if not str(e).startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")):
                raise
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException):
            pass
    with client.pipeline(transaction=False) as pipe:
        for key, offset, value in writes:
            pipe.setrange(key, offset, value)
        pipe.execute()


def _send_setranges(client: redis.Redis, writes: list[tuple[str, int, memoryview]]) -> None:
    parts: list[bytes | memoryview] = []
    tail = b""
    for key, offset, value in writes:  # each value's own header, then the value as it is
        head = pack_args(["SETRANGE", key, offset])
        parts.append(tail + b"*4\r\n" + head + b"$%d\r\n" % value.nbytes)
        parts.append(value)
        tail = b"\r\n"
    parts.append(tail)
    pool = client.connection_pool
    conn = pool.get_connection()
    error: redis.ResponseError | None = None
    try:
        conn.send_packed_command(parts)
        for _ in writes:  # every reply is read, so the connection goes back clean
            try:
                conn.read_response()
            except redis.ResponseError as e:  # the other writes still happened
                error = error or e
    except BaseException:
        conn.disconnect()  # replies may be left unread: never reuse it
        raise
    finally:
        pool.release(conn)
    if error is not None:
        raise error


class RespError(RedisError):
    """Redis answered an error (its message), or the connection failed."""


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
            data = await self.reader.read(_CHUNK)
            if not data:
                raise ConnectionError("Redis closed the connection")
            self.parser.feed(data)


class RespClient:
    """``await client.call("EVALSHA", ...)``: one command over asyncio streams, its reply
    (bytes, ints, lists; a Redis error raises :class:`RespError`). A pool of connections,
    each carrying one command at a time; one that failed or timed out is closed."""

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
        for args in _setup(self.username, self.password, self.db):
            self._check(await conn.call(pack(args)))
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
                reply = await conn.call(pack(args))
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
    """An asyncio client of a plain ``redis://host:port[/db]`` URL (credentials in it);
    None for the others (TLS, a cluster, a socket: the caller keeps redis-py's client)."""
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

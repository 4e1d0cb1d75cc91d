"""Commands packed as RESP by hand: the one transport for the paths where redis-py's
per-command cost shows (docs/benchmarks.md).

Through redis-py (with hiredis) each reply is read into the parser's buffer, copied into a
``bytes`` object, viewed row by row and copied again into batch order, and each command
costs ~5 µs to queue and pack: for the ~260 GETRANGEs of a 256-step image batch (10.8 MB)
that is about half of a fetch's CPU time. Here commands are packed in one pass and every
GETRANGE reply's body is received into its place in one buffer.

- :class:`Commands` and :class:`RoundTrips`: a read path's round trip. Commands are each
  queued with their own decoder (GETRANGEs whose replies fill one buffer or the caller's,
  then any other command, whose replies hiredis parses); round trips send them on a
  connection of their own, or through a redis-py pipeline where that cannot speak to the
  server (TLS, Cluster, a credential provider, RESP3) or another thread is using it.
- :func:`execute`: commands on a redis-py pipeline, scripts loaded on NOSCRIPT.
- :func:`setrange_many`: large SETRANGEs sent straight from their memory (ingest).
- :class:`RespClient`: commands over asyncio streams (the capture gateway's response path,
  where redis-py's asyncio client spends about four times its CPU on a round trip).

The own connections speak plain TCP and Unix sockets with the client's password, user and
database (:func:`plain_connection`, the one test of what they can speak to); for anything
else they are not made and redis-py carries the commands.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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
    packs their constant part once) and a function giving its arguments (``args``: for
    redis-py, called only when the commands go through it)."""

    blob: bytes
    args: Callable[[], Sequence[Any]]


Command = Sequence[Any] | Packed


class Reply:
    """What a queued command's decoder made of its reply, once the commands ran."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


def _same(reply: Any) -> Any:
    return reply


class Commands:
    """Commands for one round trip, each with its decoder: no caller counts reply
    positions. GETRANGEs queued by :meth:`into` go first (their replies land in one
    buffer, or in the caller's), the commands of :meth:`add` and :meth:`add_all` after
    them, in order."""

    def __init__(self) -> None:
        self.ranges: list[tuple[str, int, int]] = []
        self.commands: list[Command] = []
        self._into: list[tuple[int, int, Any, Callable[[np.ndarray], Any], Any, Reply]] = []
        self._add: list[tuple[int, Callable[[Any], Any], Reply]] = []

    def into(
        self,
        ranges: Sequence[tuple[str, int, int]],
        nbytes: int,
        decode: Callable[[np.ndarray], Any] = _same,
        out: np.ndarray | None = None,
        each: Callable[[list[bytes]], Any] | None = None,
    ) -> Reply:
        """``GETRANGE key start end`` of each of ``ranges`` (``nbytes`` in all); ``decode``
        gets their bytes concatenated (uint8; a reply shorter than its range, from a key
        not written yet, padded with zeros), received into ``out`` (any C-contiguous
        array of ``nbytes``) when given. ``each``, if given, decodes the replies as
        redis-py parsed them (a ``bytes`` each, maybe short) when the commands went
        through redis-py: a caller that copies the rows anyway saves copying them into
        one buffer first."""
        self._into.append((len(ranges), nbytes, out, decode, each, Reply()))
        self.ranges += ranges
        return self._into[-1][5]

    def add(self, command: Command, decode: Callable[[Any], Any] = _same) -> Reply:
        """One command; ``decode`` gets its reply."""
        return self.add_all([command], lambda replies: decode(replies[0]))

    def add_all(self, commands: Sequence[Command], decode: Callable[[list[Any]], Any]) -> Reply:
        """Several commands; ``decode`` gets the list of their replies."""
        self.commands += commands
        reply = Reply()
        self._add.append((len(commands), decode, reply))
        return reply

    def targets(self, parsed: bool) -> list[tuple[int, memoryview | None]]:
        """Per :meth:`into` call its count of ranges and the bytes its replies fill (one
        buffer for those without ``out``); with ``parsed`` (the replies come from
        redis-py) None for those decoded by ``each``."""
        keep = [parsed and out is None and each is not None for _, _, out, _, each, _ in self._into]
        own = sum(e[1] for e, k in zip(self._into, keep, strict=True) if e[2] is None and not k)
        buf = memoryview(np.empty(own, np.uint8)) if own else memoryview(b"")
        at, targets = 0, []
        for (count, n, out, _, _, _), k in zip(self._into, keep, strict=True):
            if k:
                targets.append((count, None))
            elif out is None:
                targets.append((count, buf[at : at + n]))
                at += n
            else:
                targets.append((count, memoryview(out.reshape(-1).view(np.uint8))))
        return targets

    def decode(
        self,
        targets: list[tuple[int, memoryview | None]],
        parsed: Sequence[Any],
        replies: Sequence[Any],
    ) -> None:
        """Hand each decoder its part of the replies: the bytes of ``targets`` for the
        GETRANGEs (or, where a target is None, their ``parsed`` replies), then ``replies``
        for the other commands."""
        at = 0
        for (count, mv), (_, _, _, decode, each, reply) in zip(targets, self._into, strict=True):
            if mv is None:
                reply.value = each(list(parsed[at : at + count]))
            else:
                reply.value = decode(np.frombuffer(mv, np.uint8))
            at += count
        at = 0
        for n, decode, reply in self._add:
            reply.value = decode(replies[at : at + n])
            at += n


def load(client: Client, scripts: Sequence[Any]) -> None:
    """Load ``scripts`` (objects with the ``source`` of a Lua script) on ``client``."""
    for script in scripts:
        client.script_load(script.source)


def execute(client: Client, scripts: Sequence[Any], queue: Callable[[Any], None]) -> list[Any]:
    """Run the commands ``queue`` puts on a redis-py pipeline in one round trip; on
    NOSCRIPT :func:`load` ``scripts`` and run them again (scripts only read, or are
    idempotent)."""
    try:
        return _execute(client, queue)
    except NoScriptError:
        load(client, scripts)
        return _execute(client, queue)


def _execute(client: Client, queue: Callable[[Any], None]) -> list[Any]:
    with client.pipeline(transaction=False) as pipe:
        queue(pipe)
        return pipe.execute()


def plain_connection(client: Any) -> dict[str, Any] | None:
    """The connection arguments of ``client`` when its connections are plain TCP or Unix
    sockets speaking RESP2 with a password at most (what this module's own connections
    speak: ``path`` set for a Unix socket); None for the others (TLS, a Cluster, a
    credential provider, RESP3): redis-py carries their commands."""
    if not isinstance(client, redis.Redis):
        return None
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if pool.connection_class not in (Connection, UnixDomainSocketConnection):
        return None
    if kw.get("credential_provider") or kw.get("protocol") not in (None, 2, "2"):
        return None
    return dict(kw)


class RoundTrips:
    """Runs :class:`Commands` (read-only) on ``client``'s server, each in one round trip;
    ``scripts`` (objects with the ``source`` of a Lua script its commands ``EVALSHA``) are
    loaded on NOSCRIPT and the commands sent again. Safe to share between threads and
    across a fork: a thread that finds the own connection busy, or a forked child, uses
    redis-py or a connection of its own."""

    def __init__(self, client: Client, scripts: Sequence[Any] = ()) -> None:
        self.client, self.scripts = client, list(scripts)
        self._own: tuple[int, _BulkReader | None, threading.Lock] | None = None

    def run(self, commands: Commands) -> None:
        """Send ``commands`` and set each of their replies (a Redis error raises, after
        every reply was read)."""
        _, reader, lock = self._state()
        if reader is not None and lock.acquire(blocking=False):
            try:
                targets = commands.targets(parsed=False)
                cs = commands.commands
                blob = b"".join(c.blob if isinstance(c, Packed) else pack(c) for c in cs)
                try:
                    replies = reader.run(commands.ranges, targets, blob, len(cs))
                except NoScriptError:
                    load(self.client, self.scripts)
                    replies = reader.run(commands.ranges, targets, blob, len(cs))
            finally:
                lock.release()
            commands.decode(targets, (), replies)
        else:
            targets = commands.targets(parsed=True)
            ranges, replies = self._pipeline(commands, targets)
            commands.decode(targets, ranges, replies)

    @property
    def lock(self) -> threading.Lock:
        """Held while commands are on the own connection."""
        return self._state()[2]

    def reader(self) -> _BulkReader | None:
        """The own connection; None where it cannot speak to the server."""
        return self._state()[1]

    def close(self) -> None:
        """Close the own connection (the next run opens another)."""
        if self._own is not None and self._own[1] is not None:
            self._own[1].close()

    def _state(self) -> tuple[int, _BulkReader | None, threading.Lock]:
        """This process's own connection and its lock, taken together (made again in a
        forked child: a socket is not shared across processes, and the lock may be held
        there by no thread)."""
        own = self._own
        if own is None or own[0] != os.getpid():
            kw = plain_connection(self.client)
            reader = None if kw is None else _BulkReader(kw)
            own = self._own = (os.getpid(), reader, threading.Lock())
        return own

    def _pipeline(
        self, commands: Commands, targets: list[tuple[int, memoryview | None]]
    ) -> tuple[list[Any], list[Any]]:
        """The GETRANGEs' replies (each copied once into its target, if it has one) and the
        other commands', through a redis-py pipeline."""

        def queue(pipe: Any) -> None:
            for key, start, end in commands.ranges:
                pipe.getrange(key, start, end)
            for c in commands.commands:
                pipe.execute_command(*(c.args() if isinstance(c, Packed) else c))

        replies = execute(self.client, self.scripts, queue)
        at = 0
        for count, mv in targets:  # each reply copied once into its place
            at += count
            if mv is None:
                continue
            pos = 0
            for (_, start, end), raw in zip(
                commands.ranges[at - count : at], replies[at - count : at], strict=True
            ):
                want, n = end - start + 1, len(raw)
                mv[pos : pos + n] = raw
                if n < want:
                    mv[pos + n : pos + want] = bytes(want - n)
                pos += want
        n = len(commands.ranges)
        return replies[:n], replies[n:]


class _BulkReader:
    """One plain connection; not thread-safe (:class:`RoundTrips` holds it under a lock)."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs, self.unix = kwargs, "path" in kwargs
        self.sock: socket.socket | None = None
        self.buf = bytearray(_CHUNK)
        self.mv = memoryview(self.buf)
        self.start = self.end = 0  # unread bytes: buf[start:end]

    def run(
        self,
        ranges: Sequence[tuple[str, int, int]],
        targets: list[tuple[int, memoryview]],
        tail: bytes,
        n: int,
    ) -> list[Any]:
        """In one round trip: the GETRANGEs ``ranges`` into ``targets`` (per target its
        count of ranges and the bytes they fill, in order; a reply shorter than its range
        padded with zeros), then the ``n`` commands packed in ``tail``, whose replies come
        back as hiredis parses them (errors as exceptions: NOSCRIPT as redis-py's
        :class:`NoScriptError`, raised once every reply is read). Any error closes the
        connection (the next call opens another); one found broken (the server restarted
        since) is replaced once at once (reads only: safe to send again)."""
        blob = _pack_getranges(ranges) + tail
        if self.sock is not None:
            try:
                return self._run_all(blob, ranges, targets, n)
            except (OSError, redis.ConnectionError):
                self.close()
        return self._run_all(blob, ranges, targets, n)

    def _run_all(
        self,
        blob: bytes,
        ranges: Sequence[tuple[str, int, int]],
        targets: list[tuple[int, memoryview]],
        n: int,
    ) -> list[Any]:
        try:
            self._run(blob, ranges, targets)
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
                got = self.sock.recv_into(self.mv)  # type: ignore[union-attr]  # the socket is open while replies are read
                if not got:
                    raise redis.ConnectionError("connection closed by the server")
                reader.feed(bytes(self.mv[:got]))
                continue
            replies.append(reply)
        if reader.has_data():
            raise redis.ResponseError("more replies than commands")
        return replies

    def _run(
        self,
        blob: bytes,
        ranges: Sequence[tuple[str, int, int]],
        targets: list[tuple[int, memoryview]],
    ) -> None:
        sock = self.sock or self._connect()
        sock.sendall(blob)
        at = 0
        for count, out in targets:
            pos = 0
            for _, start, end in ranges[at : at + count]:
                want = end - start + 1
                n = self._bulk_header()
                if n > want:
                    raise redis.ResponseError(f"GETRANGE returned {n} bytes, asked {want}")
                self._body_into(out[pos : pos + n])
                if n < want:
                    out[pos + n : pos + want] = bytes(want - n)
                pos += want
                self._expect(b"\r\n")
            at += count

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
        got = self.sock.recv_into(self.mv[self.end :])  # type: ignore[union-attr]  # the socket is open while replies are read
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
            got = self.sock.recv_into(dest[have:])  # type: ignore[union-attr]  # the socket is open while replies are read
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

    def __init__(self, kwargs: dict[str, Any], timeout: float = 2.0, max_idle: int = 64) -> None:
        self.kwargs = kwargs
        """The server's connection arguments (:func:`plain_connection`)."""
        self.timeout, self.max_idle = timeout, max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        kw = self.kwargs
        if "path" in kw:
            reader, writer = await asyncio.open_unix_connection(kw["path"])
        else:
            reader, writer = await asyncio.open_connection(kw.get("host"), kw.get("port", 6379))
        conn = _Conn(reader, writer)
        for args in _setup(kw.get("username"), kw.get("password"), kw.get("db")):
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
    """An asyncio client of the server of ``url`` when :func:`plain_connection` can speak
    to it; None for the others (the caller keeps redis-py's client)."""
    try:
        client = redis.Redis.from_url(url)
    except ValueError:  # not one server's URL (a cluster's)
        return None
    kw = plain_connection(client)
    return None if kw is None else RespClient(kw, timeout)

"""Pipelined GETRANGEs received straight into one numpy buffer, over a RESP connection of
the fetch's own.

Through redis-py (with hiredis) each reply is read into the parser's buffer, copied into a
``bytes`` object, viewed row by row and copied again into batch order, and each command
costs ~5 µs to queue and pack: for the ~260 GETRANGEs of a 256-step image batch (10.8 MB)
that is about half of the fetch's CPU time (``docs/benchmarks.md``). Here the commands are
packed in one pass and every reply's body is received into its rows of one buffer.

:meth:`BulkReader.run` sends other commands (scripts, HMGETs) after the GETRANGEs, in the
same round trip; their replies are parsed by hiredis.

Only plain TCP and Unix-socket connections, with the client's password, user and database;
for anything else (TLS, Cluster, a credential provider, RESP3) :meth:`BulkReader.for_client`
returns None and the caller reads through redis-py.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import hiredis
import redis
from redis.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import NoScriptError

_CHUNK = 1 << 16


class BulkReader:
    """One connection; not thread-safe (a sampling session uses it under its lock)."""

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
        padded with zeros). Any error closes the connection (the next call opens another);
        a connection found broken (the server restarted since) is replaced once at once."""
        blob = _pack_getranges(commands)
        if self.sock is not None:
            try:
                self._run(blob, commands, out)
                return
            except (OSError, redis.ConnectionError):  # read-only: safe to send again
                self.close()
        self._run(blob, commands, out)

    def run(
        self, ranges: Sequence[tuple[str, int, int]], out: memoryview, tail: Sequence[Sequence[Any]]
    ) -> list[Any]:
        """In one round trip: the GETRANGEs ``ranges`` into ``out`` (as :meth:`getranges`),
        then the commands ``tail``, whose replies come back as hiredis parses them (errors
        as exceptions: NOSCRIPT as redis-py's :class:`NoScriptError`, raised once every
        reply is read). A connection found broken is replaced once, as in
        :meth:`getranges` (reads only: safe to send again)."""
        blob = _pack_getranges(ranges) + b"".join(pack(args) for args in tail)
        if self.sock is not None:
            try:
                return self._run_all(blob, ranges, out, len(tail))
            except (OSError, redis.ConnectionError):
                self.close()
        return self._run_all(blob, ranges, out, len(tail))

    def run_packed(self, blob: bytes, n: int) -> list[Any]:
        """Commands packed already (:func:`pack`; a caller that sends the same ones often
        packs their constant parts once), ``n`` of them, in one round trip: their replies as
        :meth:`run` gives a tail's (reads only: a broken connection is replaced once)."""
        if self.sock is not None:
            try:
                return self._run_all(blob, (), memoryview(b""), n)
            except (OSError, redis.ConnectionError):
                self.close()
        return self._run_all(blob, (), memoryview(b""), n)

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
        try:
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
        except BaseException:
            self.close()
            raise

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
        setup = []
        if kw.get("password") is not None:
            user = [kw["username"]] if kw.get("username") else []
            setup.append(["AUTH", *user, kw["password"]])
        if kw.get("db"):
            setup.append(["SELECT", kw["db"]])
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

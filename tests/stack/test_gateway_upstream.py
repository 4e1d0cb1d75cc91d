"""The gateway's upstream client (orchestrator/gateway/upstream.py) against small asyncio
HTTP servers over real sockets: keep-alive reuse, a connection the server closed while
idle (retried once), chunked bodies read whole and piece by piece, a reply broken off."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.gateway.upstream import Upstream, UpstreamError


async def serve(handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server answering each request with ``handler(n)`` (bytes, or None to hang up);
    counts connections in the returned list."""
    conns: list[int] = []

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            reply = handler(len(conns))
            if reply is None:
                break
            writer.write(reply)
            await writer.drain()
            if handler.__name__ == "once":  # closes after one reply, no Connection: close
                break
        writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", conns


def plain(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"8\r\ndata: 1\n\r\n8\r\ndata: 2\n\r\n0\r\n\r\n"
)


def test_keep_alive_reuse_and_chunked_bodies():
    async def run() -> None:
        replies = iter([plain(b'{"a":1}'), CHUNKED, CHUNKED])
        server, url, conns = await serve(lambda n: next(replies))
        up = Upstream(url)
        r = await up.post("/v1/x", b"{}", "application/json")
        assert (r.status, r.headers["content-type"], await r.read()) == (
            200,
            "application/json",
            b'{"a":1}',
        )
        await r.close()
        r = await up.post("/v1/x", b"{}", "application/json")
        assert await r.read() == b"data: 1\ndata: 2\n"
        await r.close()
        r = await up.post("/v1/x", b"{}", "application/json")
        assert [c async for c in r.chunks()] == [b"data: 1\n", b"data: 2\n"]
        await r.close()
        assert len(conns) == 1  # one connection, kept alive
        await up.aclose()
        server.close()

    asyncio.run(run())


def test_idle_connection_closed_by_the_server_is_retried_once():
    async def run() -> None:
        def once(n: int) -> bytes:
            return plain(b"%d" % n)

        server, url, conns = await serve(once)
        up = Upstream(url)
        for want in (b"1", b"2", b"3"):
            r = await up.post("/", b"{}", "application/json")
            assert await r.read() == want
            await r.close()
            await asyncio.sleep(0.05)  # the server hangs up the idle connection meanwhile
        assert len(conns) == 3
        await up.aclose()
        server.close()

    asyncio.run(run())


def test_a_reply_broken_off_or_no_server_is_an_upstream_error():
    async def run() -> None:
        def once(_: int) -> bytes:  # a body cut short, then the server hangs up
            return b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part"

        server, url, _ = await serve(once)
        r = await Upstream(url).post("/", b"{}", "application/json")
        with pytest.raises(UpstreamError, match="closed the connection mid-reply"):
            await r.read()
        await r.close()
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await Upstream(url).post("/", b"{}", "application/json")
        with pytest.raises(ValueError, match="http:// or https://"):
            Upstream("ftp://x")

    asyncio.run(run())

"""The gateway's own RESP client against a real redis-server: credentials and database
from the URL, errors as RespError (NOSCRIPT included), a server that stops answering is a
timeout, not a hang; TCP and Unix sockets; URLs it does not speak fall back to redis-py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis

from claw_tasks.connection.resp import RespError, connect
from claw_tasks.connection.server import RedisServer


def test_resp_client_speaks_the_urls_it_can():
    with RedisServer() as server:
        redis.Redis.from_url(server.url).config_set("requirepass", "s3cret")
        base = f"redis://:s3cret@127.0.0.1:{server.port}"

        async def run() -> None:
            c = connect(base + "/3", timeout=1.0)
            assert c is not None
            assert await c.call("SET", "k", "v") == b"OK"
            assert await c.call("EVAL", "return {1, 'a', {2}}", 0) == [1, b"a", [2]]
            with pytest.raises(RespError, match="NOSCRIPT"):
                await c.call("EVALSHA", "0" * 40, 0)
            with pytest.raises(RespError, match="WRONGTYPE"):
                await c.call("HGET", "k", "f")
            assert await c.call("GET", "k") == b"v"  # the connection survived the errors
            bad = connect(f"redis://:wrong@127.0.0.1:{server.port}", timeout=1.0)
            assert bad is not None
            with pytest.raises(RespError):
                await bad.call("PING")
            pid = redis.Redis.from_url(base).info()["process_id"]
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(RespError, match="TimeoutError"):
                    await c.call("GET", "k")
            finally:
                os.kill(pid, signal.SIGCONT)
            assert await c.call("GET", "k") == b"v"  # a new connection
            await c.aclose()

        asyncio.run(run())
        assert redis.Redis.from_url(base + "/3").get("k") == b"v"  # database 3
        redis.Redis.from_url(base).config_set("requirepass", "")  # the server stops as usual
    for url in ("rediss://h:1", "redis+cluster://h:1", "redis://h:1,h:2"):
        assert connect(url, 1.0) is None


def test_resp_client_speaks_over_a_unix_socket(tmp_path):
    sock = tmp_path / "r.sock"
    with RedisServer(options={"unixsocket": str(sock), "unixsocketperm": "700"}) as server:
        server.client().set("k", b"v")

        async def run() -> None:
            c = connect(f"unix://{sock}", timeout=1.0)
            assert c is not None
            assert await c.call("GET", "k") == b"v"
            await c.aclose()

        asyncio.run(run())

"""Peak RSS of `claw gateway` and `claw web` under oversized traffic.

    .venv/bin/python bench/http_memory.py [--root CHECKOUT]

Starts a private redis-server and the test upstream (tests/support/llm_upstream.py, whose
``huge:<bytes>`` model answers that many bytes), then, each in a fresh process run from
``--root`` (default: this checkout; give an older one to compare) with default settings:
a 150 MB non-streamed reply and a 150 MB stream without ``[DONE]`` through `claw
gateway`, read whole by the client; an unauthenticated chunked ``POST /login`` of 300
form fields of 1 MiB to `claw web`. Prints each process's peak RSS (VmHWM) before and
after.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from claw_tasks.connection.server import RedisServer  # noqa: E402
from tests.support.gateway import train_tokenizer  # noqa: E402
from tests.support.processes import free_port  # noqa: E402

MiB = 1 << 20
SIZE = 150_000_000


def peak_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024


def start(cmd: list[str], root: Path, env: dict[str, str], port: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-m", *cmd], cwd=root, env={**env, "PYTHONPATH": str(root)}
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return p
        except OSError:
            assert time.monotonic() < deadline and p.poll() is None, cmd
            time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=HERE)
    root = ap.parse_args().root.resolve()
    env = {**os.environ, "CLAW_GATEWAY_TOKEN": "t", "CLAW_WEB_PASSWORD": "pw"}
    tokenizer = Path("/tmp/claw-bench-tokenizer.json")
    train_tokenizer(tokenizer)
    with RedisServer() as redis:
        up = free_port()
        upstream = start(["tests.support.llm_upstream", str(up), str(tokenizer)], HERE, env, up)
        for stream in (False, True):
            port = free_port()
            gw = start(
                [
                    "orchestrator.cli.main",
                    "--redis-url",
                    redis.url,
                    "gateway",
                    "--upstream",
                    f"http://127.0.0.1:{up}",
                    "--namespace",
                    "bench",
                    "--port",
                    str(port),
                ],
                root,
                env,
                port,
            )
            time.sleep(1)
            before, t0, got = peak_mib(gw.pid), time.perf_counter(), 0
            body = {"model": f"huge:{SIZE}", "messages": [{"role": "user", "content": "hi"}]}
            with httpx.stream(
                "POST",
                f"http://127.0.0.1:{port}/t/x/v1/chat/completions",
                json={**body, "stream": stream},
                headers={"Authorization": "Bearer t"},
                timeout=300,
            ) as r:
                for piece in r.iter_raw():
                    got += len(piece)
            what = "stream without [DONE]" if stream else "reply"
            print(
                f"gateway, a 150 MB {what}: {got} bytes relayed in "
                f"{time.perf_counter() - t0:.1f} s; peak RSS {before:.0f} -> "
                f"{peak_mib(gw.pid):.0f} MiB"
            )
            gw.terminate()
            gw.wait()
        upstream.terminate()
        upstream.wait()

        port = free_port()
        web_env = {**env, "CLAW_REDIS_URL": redis.url, "CLAW_BROKER_URL": redis.url}
        web = start(["orchestrator.cli.main", "web", "--port", str(port)], root, web_env, port)
        time.sleep(1)
        before = peak_mib(web.pid)

        def fields() -> Iterator[bytes]:
            for k in range(300):
                yield b"f%d=" % k + b"x" * (MiB - 16) + b"&"

        try:
            status: object = httpx.post(
                f"http://127.0.0.1:{port}/login",
                content=fields(),
                headers={"content-type": "application/x-www-form-urlencoded"},
                timeout=300,
            ).status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        time.sleep(0.5)
        print(
            f"web, POST /login of 300 x 1 MiB fields, no session: {status}; peak RSS "
            f"{before:.0f} -> {peak_mib(web.pid):.0f} MiB"
        )
        web.terminate()
        web.wait()


if __name__ == "__main__":
    main()

"""What the two GRPO examples (``grpo_toy.py``, ``trl_grpo.py``) share: the small
OpenAI-compatible inference server's HTTP side, ``claw gateway`` as a subprocess in front
of it, and one agent trajectory through the gateway (a call with the real ``openai``
client, then its reward posted to the gateway). Not an example of its own: the scripts
import it from their folder (``python examples/<script>.py`` puts it on ``sys.path``)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai


class CompletionServer:
    """``POST /v1/completions`` on a free local port, answered by ``complete`` (the reply
    and the policy version that sampled it, sent in the ``X-Claw-Policy-Version`` header,
    which the gateway records). Subclasses set their state, then call ``__init__``."""

    def __init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the gateway reuses its connections

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                out, version = server.complete(body)
                reply = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.send_header("X-Claw-Policy-Version", str(version))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                pass

        class HTTPServer(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 1024  # the gateway opens a connection per concurrent call

        self.http = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        raise NotImplementedError


class Gateway:
    """``claw gateway`` in front of the server, as a subprocess: same Redis
    (CLAW_REDIS_URL), fresh random tokens for the agents and for the reward endpoint."""

    def __init__(self, upstream: str, namespace: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.token, self.reward_token = secrets.token_hex(16), secrets.token_hex(16)
        env = {
            **os.environ,
            "CLAW_GATEWAY_TOKEN": self.token,
            "CLAW_GATEWAY_REWARD_TOKEN": self.reward_token,
        }
        cmd = ["gateway", "--upstream", upstream, "--namespace", namespace, "--port", str(port)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli.main", *cmd, "--max-turns", "4"],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{self.url}/healthz", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        "claw gateway did not start (see its output above)"
                    ) from None
                time.sleep(0.2)

    def counts(self) -> dict[str, float]:
        """Its Prometheus counters (``/metrics`` takes the agents' token when no
        CLAW_METRICS_TOKEN is set)."""
        page = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {self.token}"})
        page.raise_for_status()
        return {
            name: float(value)
            for name, _, value in (ln.partition(" ") for ln in page.text.splitlines())
            if name.startswith("claw_gateway_") and name.endswith("_total")
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rollout(
    http: httpx.Client,
    gw: Gateway,
    traj: str,
    group: str,
    prompt: Any,
    *,
    model: str,
    max_tokens: int,
    reward: Callable[[str], float],
) -> float:
    """One trajectory: a call through the gateway with the OpenAI client, then
    ``reward(completion text)`` posted to the gateway (which ends the trajectory)."""
    client = openai.OpenAI(
        base_url=f"{gw.url}/t/{traj}/g/{group}/v1",
        api_key=gw.token,
        http_client=http,
        max_retries=0,
    )
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
    value = reward(out.choices[0].text)
    r = http.post(
        f"{gw.url}/t/{traj}/reward",
        json={"final_reward": value, "reward_source": "exact"},
        headers={"Authorization": f"Bearer {gw.reward_token}"},
    )
    if r.status_code != 200:
        raise RuntimeError(f"reward of {traj}: {r.status_code} {r.text}")
    return value

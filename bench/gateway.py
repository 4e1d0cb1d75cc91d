"""The capture gateway's added latency per call and its recorded turns/s.

    .venv/bin/python bench/gateway.py [--calls 2000] [--load-calls 4000] [--threads 8]

Starts a private redis-server, one ingest worker (prefork, concurrency 2), the vLLM-like
test upstream (tests/support/llm_upstream.py: token ids and log-probs per vLLM's fields) and
`claw gateway` in front of it, all as separate processes. Latency: one keep-alive client
alternates the same non-streaming chat call (a 2-message prompt, a 27-token tool call
reply) directly to the upstream and through the gateway, ``--calls`` of each; added
latency is the difference of the medians (and of the 99th percentiles). The gateway's CPU
time per call (from /proc, recording included) does not depend on the machine's load. Throughput:
``--threads`` clients send ``--load-calls`` calls through the gateway; recorded turns/s
is counted from the first call until the store holds them all (committed by the worker).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from tests.stack.test_gateway import TOKEN, TOOLS, Proc, free_port, train_tokenizer
from tests.support.processes import Worker

BODY = {
    "model": "sim",
    "messages": [
        {"role": "system", "content": "You add numbers with the tool."},
        {"role": "user", "content": "What is 12 plus 30?"},
    ],
    "tools": TOOLS,
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (/proc), independent of the machine's load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latency(client: httpx.Client, direct: str, gateway: str, n: int) -> dict[str, np.ndarray]:
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for i in range(n):
        for name, url in (("direct", direct), ("gateway", gateway))[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            r = client.post(url, json=BODY, headers=auth if name == "gateway" else None)
            out[name].append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return {k: np.array(v) * 1e3 for k, v in out.items()}


def load(gw: Proc, store: Store, calls: int, threads: int) -> tuple[float, float, int]:
    per = calls // threads
    base = store.info()["steps"]

    def run(t: int) -> None:
        with httpx.Client(timeout=60) as c:
            for i in range(per):
                url = f"{gw.url}/t/load-{t}-{i}/g/q{i % 16}/v1/chat/completions"
                r = c.post(url, json=BODY, headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status_code == 200, r.text

    t0 = time.perf_counter()
    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    sent = time.perf_counter() - t0
    want = base + per * threads
    while store.info()["steps"] < want:
        time.sleep(0.02)
    return time.perf_counter() - t0, sent, per * threads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--load-calls", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(f"/tmp/claw-bench-gateway-{uuid.uuid4().hex[:6]}")
    tmp.mkdir()
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    with RedisServer() as server:
        worker = Worker(server.url, "ingest", 2, tmp / "worker.log", {})
        up_port, gw_port = free_port(), free_port()
        upstream = Proc(
            [sys.executable, "-m", "tests.support.llm_upstream", str(up_port), str(tokenizer)],
            up_port,
            tmp / "upstream.log",
            {},
        )
        ns = "bench-gw"
        gw = Proc(
            [
                sys.executable,
                "-m",
                "orchestrator.cli.main",
                "--redis-url",
                server.url,
                "gateway",
                "--upstream",
                upstream.url,
                "--namespace",
                ns,
                "--port",
                str(gw_port),
                "--max-turns",
                "100000",
            ],
            gw_port,
            tmp / "gateway.log",
            {"CLAW_GATEWAY_TOKEN": TOKEN},
        )
        try:
            store = Store(server.url, ns)
            with httpx.Client(timeout=60) as c:
                latency(
                    c,
                    upstream.url + "/v1/chat/completions",
                    gw.url + "/t/warm/g/q/v1/chat/completions",
                    50,
                )
                cpu0 = cpu_seconds(gw.proc.pid), cpu_seconds(upstream.proc.pid)
                lat = latency(
                    c,
                    upstream.url + "/v1/chat/completions",
                    gw.url + "/t/lat/g/q/v1/chat/completions",
                    args.calls,
                )
                while store.info()["steps"] < args.calls:  # recording included
                    time.sleep(0.02)
                cpu = (cpu_seconds(gw.proc.pid) - cpu0[0], cpu_seconds(upstream.proc.pid) - cpu0[1])
            elapsed, sent, n = load(gw, store, args.load_calls, args.threads)
        finally:
            gw.stop()
            upstream.stop()
            worker.stop()
    d, g = lat["direct"], lat["gateway"]
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}; python {platform.python_version()}"
    )
    print(
        f"latency over {args.calls} calls each (ms): direct p50 {np.median(d):.2f} "
        f"p99 {np.percentile(d, 99):.2f}; gateway p50 {np.median(g):.2f} "
        f"p99 {np.percentile(g, 99):.2f}; added p50 {np.median(g) - np.median(d):.2f} "
        f"p99 {np.percentile(g, 99) - np.percentile(d, 99):.2f}"
    )
    print(
        f"CPU per call: gateway {cpu[0] / args.calls * 1e3:.2f} ms (forwarding and "
        f"recording), upstream {cpu[1] / (2 * args.calls) * 1e3:.2f} ms"
    )
    print(
        f"load: {n} calls from {args.threads} threads answered in {sent:.2f} s "
        f"({n / sent:.0f} calls/s), all recorded after {elapsed:.2f} s: "
        f"{n / elapsed:.0f} recorded turns/s"
    )


if __name__ == "__main__":
    main()

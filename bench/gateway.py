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

Before any budget is declared, ``--calls`` pairs with a new trajectory per call through
the gateway with admission on (no trainer: what a capture-only setup pays).

With admission and sessions on (a trainer's recipe declares a staleness budget, here one
no call reaches): ``--calls`` more pairs each for (1) one session's trajectory called with
its key (the key checked once, then trusted), (2) every call a new trajectory with the
shared token (each call's admission: one script round trip), (3) every call a new
session's first call (the key check and the admission: one script round trip); and, to
compare with (2), every call a new trajectory through a second gateway started with
``--no-admission`` (which also serves one trajectory, as does the first gateway, with the
shared token); every round one call of each, the order rotated, so that they see the same
load. Each admission-on mode is also measured alone first, pairs with the direct call as for
the first figure. Then the gate's check alone, in this process.

The spool's cost: ``--calls`` rounds, interleaved, of the direct call and one call through
each of two more gateways, one with its spool (the default: every answered call written
to local disk before its reply) and one with ``--spool off``, one trajectory each, and
each one's CPU per call. ``--only-spool`` runs this part alone. (The gateways above run
with their default spool.)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from tests.stack.test_gateway import TOOLS
from tests.support.gateway import TOKEN, Proc, gateway_argv, start_upstream, train_tokenizer
from tests.support.processes import Worker, free_port

ADMIN = "bench-admin-token"
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


def latency(
    client: httpx.Client,
    direct: str,
    gateway: str | Callable[[int], str],
    n: int,
    key: str | Callable[[int], str] = TOKEN,
) -> dict[str, np.ndarray]:
    """``n`` pairs of the call, direct and through the gateway, alternating which goes
    first; ``gateway`` and ``key`` may depend on the call's number."""
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    for i in range(n):
        gw_url = gateway(i) if callable(gateway) else gateway
        auth = {"Authorization": f"Bearer {key(i) if callable(key) else key}"}
        for name, url in (("direct", direct), ("gateway", gw_url))[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            r = client.post(url, json=BODY, headers=auth if name == "gateway" else None)
            out[name].append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return {k: np.array(v) * 1e3 for k, v in out.items()}


def interleaved(
    client: httpx.Client,
    targets: dict[str, tuple[Callable[[int], str], Callable[[int], str | None]]],
    n: int,
) -> dict[str, np.ndarray]:
    """``n`` rounds of one call to each target (url, key of the round), the order rotated
    each round, so that every target sees the same load; latencies in ms."""
    names = list(targets)
    out: dict[str, list[float]] = {k: [] for k in names}
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            url, key = targets[name]
            token = key(i)
            headers = {"Authorization": f"Bearer {token}"} if token else None
            t0 = time.perf_counter()
            r = client.post(url(i), json=BODY, headers=headers)
            out[name].append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return {k: np.array(v) * 1e3 for k, v in out.items()}


def added(lat: dict[str, np.ndarray]) -> str:
    d, g = lat["direct"], lat["gateway"]
    return (
        f"direct p50 {np.median(d):.2f} p99 {np.percentile(d, 99):.2f}; gateway p50 "
        f"{np.median(g):.2f} p99 {np.percentile(g, 99):.2f}; added p50 "
        f"{np.median(g) - np.median(d):.2f} p99 {np.percentile(g, 99) - np.percentile(d, 99):.2f}"
    )


def declare_budget(redis_url: str, namespace: str) -> None:
    """A trainer's recipe with admission, its budget out of reach (every call admitted,
    every first call checked)."""
    from orchestrator import BatchClient

    recipe = {
        "name": "bench-admission",
        "batch_size": 64,
        "fields": ["response_ids"],
        "params": {"policy_version": 0},
        "admission": {"max_staleness": 10**9},
        "sources": [{"name": "all", "sampler": {"kind": "group", "group_size": 8}}],
    }
    with BatchClient(namespace, redis_url) as client:
        client.register(recipe)


def gate_cost(redis_url: str, namespace: str, n: int) -> dict[str, tuple[float, float]]:
    """The gate's first-call check in this process, without HTTP: (wall, CPU) microseconds
    per new trajectory, through the gateway's RESP client and through redis-py's asyncio
    client (what a TLS or cluster URL uses)."""
    import asyncio

    from orchestrator.gateway.gate import Gate, Principal
    from orchestrator.gateway.metrics import GatewayMetrics

    async def run(fast: bool) -> tuple[float, float]:
        gate = Gate(Store(redis_url, namespace), redis_url, GatewayMetrics())
        if not fast:
            gate.fast = None
        tag = "fast" if fast else "redis-py"
        for i in range(100):
            await gate.enter(Principal(), (f"warm-{tag}-{i}",), "q")
        c0, t0 = os.times(), time.perf_counter()
        for i in range(n):
            await gate.enter(Principal(), (f"gate-{tag}-{i}",), f"q{i % 16}")
        c1 = os.times()
        await gate.aclose()
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        return (time.perf_counter() - t0) / n * 1e6, cpu / n * 1e6

    return {
        "the gateway's RESP client": asyncio.run(run(True)),
        "redis-py asyncio": asyncio.run(run(False)),
    }


def sessions(gw: Proc, n: int) -> list[dict]:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(timeout=60) as c:
        made = [c.post(gw.url + "/sessions", json={"group": "q"}, headers=auth) for _ in range(n)]
    assert all(r.status_code == 201 for r in made), made[0].text
    return [r.json() for r in made]


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


def spool_cost(
    gateway: Callable[..., Proc], upstream: Proc, ns: str, n: int
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Latency of the call through a gateway with its spool and one with ``--spool off``
    (interleaved with the direct call), and each gateway's CPU ms per call."""
    on, off = (
        gateway(free_port(), ns + "-spool"),
        gateway(free_port(), ns + "-nospool", "--spool", "off"),
    )
    chat = "/v1/chat/completions"
    procs = {"spool on": on, "spool off": off}
    targets: dict[str, tuple[Callable[[int], str], Callable[[int], str | None]]] = {
        "direct": (lambda i: upstream.url + chat, lambda i: None),
        "spool on": (lambda i: f"{on.url}/t/one/g/q{chat}", lambda i: TOKEN),
        "spool off": (lambda i: f"{off.url}/t/one/g/q{chat}", lambda i: TOKEN),
    }
    try:
        with httpx.Client(timeout=60) as c:
            interleaved(c, targets, 50)  # warm
            cpu0 = {k: cpu_seconds(p.proc.pid) for k, p in procs.items()}
            got = interleaved(c, targets, n)
        cpu = {k: (cpu_seconds(p.proc.pid) - cpu0[k]) / n * 1e3 for k, p in procs.items()}
    finally:
        on.stop()
        off.stop()
    return got, cpu


def print_spool_cost(got: dict[str, np.ndarray], cpu: dict[str, float], n: int) -> None:
    d = got["direct"]
    print(f"spool, interleaved, {n} calls each (ms): direct p50 {np.median(d):.3f}")
    for mode in ("spool on", "spool off"):
        g = got[mode]
        print(
            f"  {mode}: p50 {np.median(g):.3f} p99 {np.percentile(g, 99):.2f}, added p50 "
            f"{np.median(g) - np.median(d):.3f}; gateway CPU per call {cpu[mode]:.3f} ms"
        )
    extra = np.median(got["spool on"]) - np.median(got["spool off"])
    print(f"  the spool's added p50: {extra:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--load-calls", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--only-spool", action="store_true", help="only the spool's cost")
    args = ap.parse_args()
    tmp = Path(f"/tmp/claw-bench-gateway-{uuid.uuid4().hex[:6]}")
    tmp.mkdir()
    tokenizer = tmp / "tokenizer.json"
    train_tokenizer(tokenizer)
    with RedisServer() as server:
        worker = Worker(server.url, "ingest", 2, tmp / "worker.log", {})
        gw_port = free_port()
        upstream = start_upstream(tokenizer, tmp / "upstream.log")
        ns = "bench-gw"

        def gateway(port: int, namespace: str, *extra: str) -> Proc:
            cmd = gateway_argv(
                upstream.url, namespace, port, "--max-turns", "100000", *extra, redis_url=server.url
            )
            env = {"CLAW_GATEWAY_TOKEN": TOKEN, "CLAW_GATEWAY_ADMIN_TOKEN": ADMIN}
            return Proc(cmd, port, tmp / f"gateway-{port}.log", env)

        if args.only_spool:
            try:
                got, spool_cpu = spool_cost(gateway, upstream, ns, args.calls)
            finally:
                upstream.stop()
                worker.stop()
            print(
                f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} "
                f"cores, load {os.getloadavg()[0]:.1f}; python {platform.python_version()}"
            )
            print_spool_cost(got, spool_cpu, args.calls)
            return
        gw = gateway(gw_port, ns)
        off = gateway(free_port(), ns + "-off", "--no-admission")
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
            with httpx.Client(timeout=60) as c:  # admission on, before any budget exists
                before = cpu_seconds(gw.proc.pid)
                undeclared = latency(
                    c,
                    upstream.url + "/v1/chat/completions",
                    lambda i: f"{gw.url}/t/nb-{i}/g/q{i % 16}/v1/chat/completions",
                    args.calls,
                )
                undeclared_cpu = (cpu_seconds(gw.proc.pid) - before) / args.calls * 1e3
            declare_budget(server.url, ns)
            one = sessions(gw, 1)[0]
            fresh = sessions(gw, args.calls)
            direct = upstream.url + "/v1/chat/completions"
            chat = "/v1/chat/completions"
            targets: dict[str, tuple[Callable[[int], str], Callable[[int], str | None]]] = {
                "direct": (lambda i: direct, lambda i: None),
                "--no-admission, one trajectory (shared token)": (
                    lambda i: f"{off.url}/t/one/g/q{chat}",
                    lambda i: TOKEN,
                ),
                "--no-admission, a new trajectory per call": (
                    lambda i: f"{off.url}/t/off-{i}/g/q{i % 16}{chat}",
                    lambda i: TOKEN,
                ),
                "admission on, one trajectory (shared token)": (
                    lambda i: f"{gw.url}/t/one-on/g/q{chat}",
                    lambda i: TOKEN,
                ),
                "admission on, one session's trajectory (its key)": (
                    lambda i: gw.url + one["base_path"] + "/chat/completions",
                    lambda i: one["key"],
                ),
                "admission on, a new trajectory per call (a script call each)": (
                    lambda i: f"{gw.url}/t/new-{i}-{len(alone)}/g/q{i % 16}{chat}",
                    lambda i: TOKEN,
                ),
                "admission on, a new session per call (key check + admission: one call)": (
                    lambda i: gw.url + fresh[i]["base_path"] + "/chat/completions",
                    lambda i: fresh[i]["key"],
                ),
            }
            alone: dict[str, tuple[dict[str, np.ndarray], float]] = {}
            with httpx.Client(timeout=60) as c:
                for mode in list(targets)[4:]:  # admission on: as the first figure is made
                    url, key = targets[mode]
                    before = cpu_seconds(gw.proc.pid)
                    got = latency(c, direct, url, args.calls, lambda i, k=key: k(i) or "")
                    alone[mode] = got, (cpu_seconds(gw.proc.pid) - before) / args.calls * 1e3
            fresh = sessions(gw, args.calls)  # the keys above have called: new ones
            cpu0 = cpu_seconds(off.proc.pid), cpu_seconds(gw.proc.pid)
            with httpx.Client(timeout=60) as c:
                modes = interleaved(c, targets, args.calls)
            mode_cpu = (
                (cpu_seconds(off.proc.pid) - cpu0[0]) / (2 * args.calls) * 1e3,
                (cpu_seconds(gw.proc.pid) - cpu0[1]) / (4 * args.calls) * 1e3,
            )
            gate = gate_cost(server.url, ns, args.calls)
            spool_lat, spool_cpu = spool_cost(gateway, upstream, ns, args.calls)
            budget = store.r.hgetall(store.owned_key("admission"))
        finally:
            for p in (off, gw):
                p.stop()
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
        f"admission on, no budget declared, a new trajectory per call, {args.calls} calls "
        f"each (ms): {added(undeclared)}\n  gateway CPU per call {undeclared_cpu:.2f} ms"
    )
    for mode, (got, cpu_ms) in alone.items():
        print(f"{mode}, alone, {args.calls} calls each (ms): {added(got)}")
        print(f"  gateway CPU per call {cpu_ms:.2f} ms")
    d = modes.pop("direct")
    print(
        f"interleaved, {args.calls} calls each (ms): direct p50 {np.median(d):.2f} "
        f"p99 {np.percentile(d, 99):.2f}"
    )
    for mode, got in modes.items():
        print(
            f"  {mode}: p50 {np.median(got):.2f} p99 {np.percentile(got, 99):.2f}, added p50 "
            f"{np.median(got) - np.median(d):.2f}"
        )
    print(
        f"  gateway CPU per call: --no-admission {mode_cpu[0]:.2f} ms (its two modes), "
        f"admission on {mode_cpu[1]:.2f} ms (its four)"
    )
    for client_kind, (wall, cpu_us) in gate.items():
        print(
            f"gate check of a new trajectory, {client_kind}: {wall:.0f} us wall, "
            f"{cpu_us:.0f} us CPU"
        )
    print_spool_cost(spool_lat, spool_cpu, args.calls)
    refused = int(budget.get(b"refused", 0))
    print(f"admission counters: total {int(budget[b'total'])}, refused {refused}")
    print(
        f"load: {n} calls from {args.threads} threads answered in {sent:.2f} s "
        f"({n / sent:.0f} calls/s), all recorded after {elapsed:.2f} s: "
        f"{n / elapsed:.0f} recorded turns/s"
    )


if __name__ == "__main__":
    main()

"""The chaos soak: Claw spread over simulated hosts (tests/soak/hosts.py) while a seeded
schedule of faults runs, judged from the outside at the end.

Topology (one network namespace per host, each with its own ``/dev/shm``):

- ``a``, ``b``, ``c``: the store, a 3-master Redis Cluster with one replica per master on
  another host (``redis-cli --cluster create --cluster-replicas 1`` places them);
- ``c``: the broker (a standalone Redis, which also keeps beat's schedule) and beat, its
  schedule shortened (eviction every 10 s, archival every 60 s);
- ``b``, ``c``: a worker each (ingest, prefetch, maintenance);
- ``d``, ``e``: actors recording CartPole episodes, on-policy segments and PettingZoo
  joint steps, and agents calling the capture gateway with the ``openai`` client; ``d``
  also runs the gateway and the inference server behind it (tests/support/llm_upstream.py);
- ``f``: trainers popping a replay, a rollout, a joint and a GRPO group recipe with
  admission (inline over TCP: no shared memory across hosts), and ``nearest()`` queries
  against a vector index of the replay namespace.

Faults, drawn from ``--seed`` and printed before they run: SIGKILL of a worker, of beat,
of a trainer, of the gateway (each restarted), of a cluster master (its replica takes
over; the node comes back as a replica), and partitions of an actor's, a worker's, the
trainer's or a store host's link, 5-20 s each.

Verdicts (tests/soak/roles.py): every episode an actor saw confirmed is stored once and
whole (the workers confirm a commit once a replica has it: ``CLAW_INGEST_REPLICAS=1``,
``--ingest-replicas``); no step stored twice; the archive holds no step twice; no rollout
served twice or with another version's steps; every joint row aligned and whole; every
turn of a rewarded trajectory stored once with its reward; no GRPO row older than the
staleness bound; no admission slot leaked; every ``nearest()`` answer a stored step at the
distance given; after each fault heals, every paradigm serves again within
``RECOVERY_S``; every long-lived process stays under ``RSS_BOUND``; ``claw doctor`` is
clean. The report (one page, and JSON with ``--report``) lists the faults, per-paradigm
counts and recovery times and the largest RSS; the exit status is 1 on any violation.

    python -m tests.soak.soak --minutes 30 --seed 7 --report soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from claw_tasks.worker.command import celery_argv, worker_argv
from tests.soak.hosts import Host, Network, unavailable, wait_for
from tests.soak.roles import (
    check_grpo,
    check_joint,
    check_nearest,
    check_rollouts,
)
from tests.support.gateway import TOKENS, train_tokenizer
from tests.support.paths import ROOT

RECOVERY_S = 120.0
"""How soon after a fault heals every paradigm must serve again: its trainer (or the
querier) a batch (an answer) and its producer on each actor host a confirmation."""
BEAT_TAKEOVER_S = 90.0
"""How soon a restarted beat must take the lock a SIGKILLed one held (its lock lapses in
30 s: claw_tasks.broker.app.BEAT_LOCK_S)."""
FAILOVER_WINDOW_S = 10.0
"""A confirmed episode the store lacks counts as lost to a failover (not a violation) when
it was confirmed at most this long before a master was SIGKILLed."""
RSS_BOUND = 1536 * 2**20
"""The largest resident set a long-lived process (worker, pool process, beat, trainer,
actor) may reach."""
HOSTS = ("a", "b", "c", "d", "e", "f")
CLUSTER = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000")
PY = sys.executable


@dataclass
class Proc:
    """A long-lived process of the soak on its host, restartable."""

    role: str
    host: Host
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        self.popen = self.host.run(self.argv, log=self.log, env=self.env, cwd=ROOT)
        return self

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def term(self, timeout: float = 60.0) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def pids(self) -> list[int]:
        """The process and its descendants."""
        if self.popen is None or self.popen.poll() is not None:
            return []
        out, todo = [], [self.popen.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            with contextlib.suppress(OSError):
                todo += [
                    int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                ]
        return out


CREATE = """
import sys
from claw_tasks.format.schema import Schema
from claw_tasks.store import Store
from orchestrator import define_index
url, offpolicy, onpolicy = sys.argv[1:4]
Store(url, offpolicy).create(capacity=400_000, n_shards=3)
define_index(Store(url, offpolicy), {"name": "default", "field": "obs"})  # for nearest()
Store(url, onpolicy).create(capacity=200_000, n_shards=3, schema=Schema.rollout((4,)))
"""


PARADIGMS = """
import sys
from claw_tasks.format.schema import Schema
from claw_tasks.store import Store
url, marl, llm = sys.argv[1:4]
Store(url, marl).create(capacity=200_000, n_shards=3)
Store(url, llm).create(capacity=200_000, n_shards=3, schema=Schema.llm())
"""
GATEWAY_PORT, UPSTREAM_PORT = 8100, 8101
ADMISSION_EXPIRY_S = 30
"""The gateway's ``--admission-expiry``: a trajectory whose reward never comes (its agent
stopped) gives its group's slots back this long after its last turn."""
PARADIGMS_LOGS = {
    # paradigm: (trainer log, its serving event, the producers' logs, their event)
    "off-policy": ("trainer", "batch", "actor", "confirmed"),
    "on-policy": ("ppo-trainer", "minibatch", "rollout-actor", "confirmed"),
    "joint": ("joint-trainer", "batch", "marl-actor", "confirmed"),
    "llm": ("grpo-trainer", "batch", "llm-actor", "rewarded"),
    "nearest": ("nearest", "answer", None, None),
}
"""What shows each paradigm serving again after a fault: the trainer's (or querier's)
event and each actor host's producer event, logged after the heal."""


def redis_argv(addr: str, port: int, directory: Path, *extra: str) -> list[str]:
    """A redis-server on ``addr:port`` keeping its AOF in ``directory``."""
    return [
        "redis-server", "--bind", addr, "--port", str(port), "--dir", str(directory),
        "--appendonly", "yes", "--save", "", "--protected-mode", "no",
        "--maxmemory-policy", "noeviction", *extra,
    ]  # fmt: skip


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Soak:
    def __init__(
        self,
        minutes: float,
        seed: int,
        work: Path,
        gaps: tuple[float, float] = (20.0, 40.0),
        archive_every: str = "60s",
        replicas: int = 1,
    ) -> None:
        """``gaps``: the seconds between one fault's end and the next, drawn uniformly;
        ``archive_every``: beat's archival interval; ``replicas``: the workers'
        ``CLAW_INGEST_REPLICAS`` (0: a confirmed episode lost to a master's failover is
        reported apart, not a violation)."""
        self.minutes, self.seed, self.work, self.gaps = minutes, seed, work, gaps
        self.archive_every, self.replicas = archive_every, replicas
        self.rng = random.Random(seed)
        self.ns = f"soak-{uuid.uuid4().hex[:6]}"
        self.stop_file = work / "stop"
        self.procs: dict[str, Proc] = {}
        self.nodes: list[Proc] = []
        self.faults: list[dict] = []
        self.violations: list[str] = []
        self.rss: dict[str, int] = {}
        self._sampling = True
        self.master_kills: list[float] = []
        self.times: dict[str, float] = {}  # the deployment's and the final checks' seconds

    # ---- the deployment --------------------------------------------------------------
    def up(self, net: Network) -> None:
        self.net = net
        a, b, c = net["a"], net["b"], net["c"]
        for i, host in enumerate((a, b, c, a, b, c)):
            port = 7001 if i < 3 else 7002
            d = self.work / f"node-{host.name}-{port}"
            d.mkdir()
            node = Proc(
                f"redis-{host.name}:{port}",
                host,
                redis_argv(host.addr, port, d, *CLUSTER, "--cluster-announce-ip", host.addr),
                self.work / f"redis-{host.name}-{port}.log",
            ).start()
            node.addr, node.port = host.addr, port  # type: ignore[attr-defined]
            self.nodes.append(node)
        for node in self.nodes:
            wait_for(lambda n=node: self._cli(n.host, n.addr, n.port, "ping") == "PONG", "a node")
        seeds = [f"{n.addr}:{n.port}" for n in self.nodes]
        create = ["redis-cli", "--cluster", "create", *seeds, "--cluster-replicas", "1"]
        a.check_output([*create, "--cluster-yes"], timeout=120)
        wait_for(self._cluster_ok, "the cluster is ok", timeout=120)
        self.url = "redis+cluster://" + ",".join(seeds[:3])
        broker = Proc(
            "broker", c, redis_argv(c.addr, 7010, self.work), self.work / "broker.log"
        ).start()
        self.procs["broker"] = broker
        wait_for(lambda: self._cli(c, c.addr, 7010, "ping") == "PONG", "the broker answers")
        self.env = {
            "CLAW_REDIS_URL": self.url,
            "CLAW_BROKER_URL": f"redis://{c.addr}:7010/0",
            "CLAW_BEAT_REDIS_URL": f"redis://{c.addr}:7010/1",
            "CLAW_ARCHIVE_DIR": str(self.work / "archive"),
            "CLAW_SCHEDULE": json.dumps(
                {"claw-archive": {"every": self.archive_every}, "claw-evict": {"every": "10s"}}
            ),
            "CLAW_VISIBILITY_TIMEOUT": "30",
            "CLAW_INGEST_REPLICAS": str(self.replicas),
            "PYTHONUNBUFFERED": "1",
        }
        # The workers, the namespaces and what the other paradigms need start together
        # (each waited for below): the deployment is a fixed cost of every run, the CI
        # variant's included (the report gives its seconds).
        for host in (b, c):
            queues = "ingest,prefetch,maintenance"
            argv = worker_argv(queues, 2, name=f"soak-{host.name}", lone=True, heartbeat=False)
            self._add(f"worker-{host.name}", host, argv)
        self._add("create", net["f"], [PY, "-c", CREATE, self.url, self.ns, self.ns + "-ppo"])
        self.begin_paradigms(net)
        for host in (b, c):
            wait_for(
                lambda h=host: b"ready." in self.procs[f"worker-{h.name}"].log.read_bytes(),
                "a worker starts",
                timeout=180,
            )
        self._made("create", "the replay (with its vector index) and rollout namespaces")
        self._add("beat", c, celery_argv("beat", "-S", "redbeat.RedBeatScheduler", "-l", "INFO"))
        stop, ppo = str(self.stop_file), self.ns + "-ppo"
        for i, host in enumerate((net["d"], net["e"])):
            log = str(self.work / f"actor-{host.name}.jsonl")
            seed = str(self.seed * 10 + i)
            self._role(f"actor-{host.name}", host, "actor", self.ns, host.name, log, stop, seed)
            log = str(self.work / f"rollout-actor-{host.name}.jsonl")
            role = f"rollout-actor-{host.name}"
            self._role(role, host, "rollout-actor", ppo, host.name, log, stop, str(i + 1))
        f = net["f"]
        self._role("trainer", f, "trainer", self.ns, str(self.work / "trainer.jsonl"), stop)
        log = str(self.work / "ppo-trainer.jsonl")
        self._role("ppo-trainer", f, "ppo-trainer", ppo, log, stop)
        self.up_paradigms(net)

    def begin_paradigms(self, net: Network) -> None:
        """Start what the joint and LLM parts need first, while the workers start (waited
        for by :meth:`up_paradigms`): their namespaces, and the inference server on D."""
        d, f = net["d"], net["f"]
        argv = [PY, "-c", PARADIGMS, self.url, self.ns + "-marl", self.ns + "-llm"]
        self._add("paradigms", f, argv)
        tokenizer = self.work / "tokenizer.json"
        train_tokenizer(tokenizer)
        up = [PY, "-m", "tests.support.llm_upstream", str(UPSTREAM_PORT), str(tokenizer)]
        self._add("upstream", d, up)

    def up_paradigms(self, net: Network) -> None:
        """Joint steps, LLM turns and retrieval: Crowd actors and gateway agents on D and E,
        the gateway with its inference server on D, the joint and GRPO learners and the
        nearest() querier on F."""
        d, f, stop = net["d"], net["f"], str(self.stop_file)
        marl, llm = self.ns + "-marl", self.ns + "-llm"
        self._made("paradigms", "the joint and LLM namespaces")
        self._add("gateway", d, [
            PY, "-m", "orchestrator.cli.main", "gateway", "--namespace", llm,
            "--upstream", f"http://127.0.0.1:{UPSTREAM_PORT}", "--address", d.addr,
            "--port", str(GATEWAY_PORT), "--admission-expiry", str(ADMISSION_EXPIRY_S),
            "--spool", str(self.work / "gateway-spool"),  # the restarted one takes it over
        ], TOKENS)  # fmt: skip
        gateway = f"http://{d.addr}:{GATEWAY_PORT}"
        for i, host in enumerate((d, net["e"])):
            seed = str(self.seed * 10 + i)
            log = str(self.work / f"marl-actor-{host.name}.jsonl")
            self._role(f"marl-actor-{host.name}", host, "marl-actor", marl, host.name, log,
                       stop, seed)  # fmt: skip
            log = str(self.work / f"llm-actor-{host.name}.jsonl")
            self._role(f"llm-actor-{host.name}", host, "llm-actor", llm, host.name, log, stop,
                       seed, gateway)  # fmt: skip
        for role, ns in (("joint-trainer", marl), ("grpo-trainer", llm)):
            self._role(role, f, role, ns, str(self.work / f"{role}.jsonl"), stop)
        log = str(self.work / "nearest.jsonl")
        self._role("nearest", f, "nearest", self.ns, log, stop, str(self.seed))
        self._listening(d, UPSTREAM_PORT, "the inference server")
        self._listening(d, GATEWAY_PORT, "the gateway", d.addr)

    def _made(self, role: str, what: str) -> None:
        """Wait for the one-shot process ``role`` to exit 0 (it stays among the processes
        killed at the end until it has)."""
        popen = self.procs[role].popen
        assert popen is not None
        if popen.wait(240):
            raise RuntimeError(f"{what} were not made: {self.work / f'{role}.log'}")
        del self.procs[role]

    def _listening(self, host: Host, port: int, what: str, addr: str = "127.0.0.1") -> None:
        probe = ["bash", "-c", f"exec 3<>/dev/tcp/{addr}/{port}"]

        def up() -> bool:
            try:
                host.check_output(probe, timeout=10)
                return True
            except (RuntimeError, subprocess.TimeoutExpired):
                return False

        wait_for(up, f"{what} listens", timeout=240)

    def _role(self, role: str, host: Host, name: str, ns: str, *args: str) -> None:
        """A role of tests/soak/roles.py on ``host``."""
        self._add(role, host, [PY, "-m", "tests.soak.roles", name, self.url, ns, *args])

    def _add(
        self, role: str, host: Host, argv: list[str], env: dict[str, str] | None = None
    ) -> None:
        env = {**self.env, **(env or {})}
        self.procs[role] = Proc(role, host, argv, self.work / f"{role}.log", env).start()

    def _cli(self, host: Host, addr: str, port: int, *cmd: str) -> str:
        try:
            return host.check_output(
                ["redis-cli", "-h", addr, "-p", str(port), *cmd], timeout=10
            ).strip()
        except (RuntimeError, subprocess.TimeoutExpired):
            return ""

    def _cluster_ok(self, skip: Proc | None = None) -> bool:
        for n in self.nodes:
            if n is skip:
                continue
            info = self._cli(n.host, n.addr, n.port, "cluster", "info")
            if "cluster_state:ok" not in info:
                return False
        return True

    # ---- the faults ------------------------------------------------------------------
    def schedule(self) -> list[dict]:
        kinds = ["kill-worker", "kill-beat", "kill-trainer", "kill-master", "partition"]
        kinds.append("kill-gateway")
        out, at, end = [], 20.0, self.minutes * 60 - 30
        while at < end:
            kind = self.rng.choice(kinds)
            fault: dict = {"at": round(at, 1), "kind": kind}
            if kind == "kill-worker":
                fault["host"] = self.rng.choice("bc")
            elif kind == "kill-trainer":
                fault["trainer"] = self.rng.choice(["trainer", "ppo-trainer"])
            elif kind == "partition":
                fault["host"] = self.rng.choice("abdef")
                fault["seconds"] = round(self.rng.uniform(5, 20), 1)
            out.append(fault)
            at += self.rng.uniform(*self.gaps) + fault.get("seconds", 0)
        return out

    def inject(self, fault: dict) -> None:
        kind, t0 = fault["kind"], time.time()
        if kind in ("kill-worker", "kill-beat", "kill-trainer", "kill-gateway"):
            role = {
                "kill-beat": "beat",
                "kill-trainer": fault.get("trainer"),
                "kill-gateway": "gateway",
            }.get(kind, f"worker-{fault.get('host')}")
            proc = self.procs[role]
            proc.kill()
            time.sleep(2)
            offset = proc.log.stat().st_size if proc.log.exists() else 0
            proc.start()
            if kind == "kill-beat":  # the new beat takes the lock the dead one held
                try:
                    wait_for(
                        lambda: b"Acquired lock" in proc.log.read_bytes()[offset:],
                        "the restarted beat takes the lock",
                        timeout=BEAT_TAKEOVER_S,
                    )
                    fault["lock_s"] = round(time.time() - t0, 1)
                except AssertionError as e:
                    self.violations.append(f"beat: {e}")
        elif kind == "partition":
            host = self.net[fault["host"]]
            host.partition()
            time.sleep(fault["seconds"])
            host.heal()
        elif kind == "kill-master":
            masters = [
                n
                for n in self.nodes
                if "role:master" in self._cli(n.host, n.addr, n.port, "info", "replication")
            ]
            victim = self.rng.choice(masters)
            fault["node"] = victim.role
            victim.kill()
            try:
                wait_for(lambda: self._cluster_ok(skip=victim), "a replica takes over", 60)
            except AssertionError as e:
                self.violations.append(f"{victim.role} killed: {e}")
            victim.start()  # back as a replica of the node that took over
            wait_for(self._cluster_ok, "the node rejoins", 120)

    def recovered(self, since: float) -> dict[str, float | None]:
        """Per paradigm (:data:`PARADIGMS_LOGS`), the seconds after ``since`` until its
        trainer served again and each actor host's producer was confirmed; None past
        ``RECOVERY_S``."""
        # byte offsets already read, per log: each poll reads only what was added
        offsets: dict[Path, int] = {}
        first: dict[tuple[Path, str], float] = {}

        def first_after(path: Path, event: str) -> float | None:
            if (path, event) in first:
                return first[(path, event)]
            if not path.exists():
                return None
            with path.open("rb") as fh:
                fh.seek(offsets.get(path, 0))
                data = fh.read()
            whole = data[: data.rfind(b"\n") + 1]
            offsets[path] = offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                rec = json.loads(line)
                if rec["t"] > since:
                    first.setdefault((path, rec["event"]), rec["t"])
            return first.get((path, event))

        waits = {}
        for paradigm, (trainer, served, producer, made) in PARADIGMS_LOGS.items():
            waits[paradigm] = [(self.work / f"{trainer}.jsonl", served)]
            if producer is not None:
                waits[paradigm] += [(self.work / f"{producer}-{h}.jsonl", made) for h in "de"]
        took: dict[str, float | None] = dict.fromkeys(waits)
        deadline = since + RECOVERY_S
        while time.time() < deadline and any(t is None for t in took.values()):
            for paradigm, wanted in waits.items():
                if took[paradigm] is None:
                    got = [first_after(p, e) for p, e in wanted]
                    if all(t is not None for t in got):
                        took[paradigm] = round(max(got) - since, 1)  # type: ignore[type-var,operator]
            time.sleep(0.5)
        return took

    def lost_to_failover(self, episodes: list[str]) -> tuple[list[str], list[str]]:
        """Split the confirmed episodes the store and archive lack into those confirmed
        within ``FAILOVER_WINDOW_S`` before a master was killed (Redis replicates
        asynchronously: a master acknowledges a write before its replica has it, and a
        failover loses it; docs/reliability.md) and the rest, which are violations."""
        confirmed_at: dict[str, float] = {}
        for h in "de":
            for line in (self.work / f"actor-{h}.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if rec["event"] == "confirmed":
                    confirmed_at[rec["episode"]] = rec["t"]
        lost, unexplained = [], []
        for episode in episodes:
            t = confirmed_at.get(episode, -1.0)
            (lost if near_kill(t, self.master_kills) else unexplained).append(episode)
        return lost, unexplained

    def begin_llm_check(self) -> tuple[subprocess.Popen, dict]:
        """Start the LLM check on F (it runs beside the off-policy one) once the learners
        have stopped; the GRPO learner's verdicts with it."""
        w = self.work
        grpo = check_grpo(w / "grpo-trainer.jsonl")
        argv = [PY, "-m", "tests.soak.roles", "check-llm", self.url, self.ns + "-llm",
                str(grpo["batches"]), str(w / "check-llm.json"),
                *(str(w / f"llm-actor-{h}.jsonl") for h in "de")]  # fmt: skip
        log = w / "check-llm.log"
        return self.net["f"].run(argv, log=log, env=self.env, cwd=ROOT), grpo

    def check_paradigms(self, llm_check: tuple[subprocess.Popen, dict]) -> dict:
        """The joint, LLM/GRPO and retrieval verdicts (tests/soak/roles.py)."""
        w = self.work
        joint = check_joint([w / f"marl-actor-{h}.jsonl" for h in "de"], w / "joint-trainer.jsonl")
        near = check_nearest(w / "nearest.jsonl")
        popen, grpo = llm_check
        if popen.wait(600):
            raise RuntimeError(f"the LLM check failed: {(w / 'check-llm.log').read_text()[-3000:]}")
        llm = json.loads((w / "check-llm.json").read_text())
        for name, got in (("joint", joint), ("grpo", grpo), ("nearest", near)):
            self.violations += [f"{name}: {p}" for p in got["problems"]]
        # with replicas confirming each commit, a master's failover excuses no lost turn
        excused = [] if self.replicas else self.master_kills
        self.violations += llm_verdicts(llm, excused)
        served = {"joint": joint["batches"], "grpo": grpo["batches"]}
        served.update(nearest=near["answers"], llm=llm["rewarded_trajectories"])
        for name, n in served.items():
            if not n:
                self.violations.append(f"{name}: nothing served")
        return {"joint": joint, "grpo": grpo, "llm": llm, "nearest": near}

    def sample_rss(self) -> None:
        while self._sampling:
            for role, proc in list(self.procs.items()):
                for pid in proc.pids():
                    self.rss[role] = max(self.rss.get(role, 0), _rss(pid))
            time.sleep(2)

    # ---- the run ---------------------------------------------------------------------
    def run(self) -> dict:
        plan = self.schedule()
        print(f"soak: {self.minutes:g} min, seed {self.seed}, namespace {self.ns}")
        for fault in plan:
            print(f"  at {fault['at']:7.1f} s  {json.dumps(fault)}")
        sys.stdout.flush()
        with Network(HOSTS, shm_size="256m") as net:
            try:
                began = time.time()
                self.up(net)
                self.times["deployment_s"] = round(time.time() - began, 1)
                print(f"  deployed in {self.times['deployment_s']:g} s")
                threading.Thread(target=self.sample_rss, daemon=True).start()
                start = time.time()
                for fault in plan:
                    delay = start + fault["at"] - time.time()
                    if delay > 0:
                        time.sleep(delay)
                    t0 = time.time()
                    if fault["kind"] == "kill-master":
                        self.master_kills.append(t0)
                    self.inject(fault)
                    healed = time.time()
                    took = self.recovered(healed)
                    late = [p for p, t in took.items() if t is None]
                    fault.update(
                        duration_s=round(healed - t0, 1),
                        recovery_s=None if late else max(took.values()),  # type: ignore[type-var]
                        recovery=took,
                    )
                    self.faults.append(fault)
                    if late:
                        self.violations.append(
                            f"{', '.join(late)}: no recovery within {RECOVERY_S:g} s: {fault}"
                        )
                    print(f"  done {json.dumps(fault)}")
                    sys.stdout.flush()
                rest = start + self.minutes * 60 - time.time()
                if rest > 0:
                    time.sleep(rest)
                began = time.time()
                result = self.finish()
                self.times["checks_s"] = round(time.time() - began, 1)
                return {**result, "times": self.times}
            finally:
                self._sampling = False
                for proc in [*self.procs.values(), *self.nodes]:
                    proc.kill()

    def finish(self) -> dict:
        self.stop_file.touch()
        roles = ["trainer", "ppo-trainer", "joint-trainer", "grpo-trainer", "nearest"]
        producers = ("actor", "rollout-actor", "marl-actor", "llm-actor")
        roles += [f"{r}-{h}" for r in producers for h in "de"]
        for role in roles:
            popen = self.procs[role].popen
            assert popen is not None
            try:
                popen.wait(300)
            except subprocess.TimeoutExpired:
                self.violations.append(f"{role} did not stop within 300 s")
        llm_check = self.begin_llm_check()
        logs = [str(self.work / f"actor-{h}.jsonl") for h in "de"]
        out = self.work / "check.json"
        f = self.net["f"]
        f.check_output(
            [
                PY,
                "-m",
                "tests.soak.roles",
                "check",
                self.url,
                self.ns,
                str(self.work / "archive"),
                str(out),
                *logs,
            ],
            timeout=600,
        )
        result = json.loads(out.read_text())
        lost, unexplained = self.lost_to_failover(result["missing"] + result["partial"])
        result["lost_to_failover"] = lost
        if self.replicas:  # a commit is confirmed once a replica has it: no failover excuses
            unexplained += lost
        if unexplained:
            self.violations.append(f"confirmed episodes lost: {unexplained[:20]}")
        for key in ("n_doubled", "archive_doubles"):
            if result[key]:
                self.violations.append(f"{key}: {result[key]}")
        if not result["archived_rows"]:  # beat's archival every 60 s never ran
            self.violations.append("nothing archived: beat's maintenance did not run")
        doctor = subprocess.run(
            f.argv([PY, "-m", "orchestrator.cli.main", "doctor", self.ns]),
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            cwd=ROOT,
        )
        if doctor.returncode:
            self.violations.append(f"claw doctor: {doctor.stdout[-2000:]}{doctor.stderr[-2000:]}")
        onpolicy = check_rollouts(self.work / "ppo-trainer.jsonl")
        self.violations += onpolicy["problems"]
        if not onpolicy["rollouts"]:
            self.violations.append("no rollout was served")
        paradigms = self.check_paradigms(llm_check)
        trainer = [json.loads(x) for x in (self.work / "trainer.jsonl").read_text().splitlines()]
        broken = sum(1 for r in trainer if r["event"] == "batch" and not r["whole"])
        if broken:
            self.violations.append(f"off-policy: {broken} batches not of 64 finite obs rows")
        for role, rss in self.rss.items():
            if rss > RSS_BOUND:
                self.violations.append(f"{role}: RSS {rss / 2**20:.0f} MiB > bound")
        return {
            "minutes": self.minutes,
            "seed": self.seed,
            "faults": self.faults,
            "store": result,
            "onpolicy": onpolicy,
            **paradigms,
            "batches": sum(1 for r in trainer if r["event"] == "batch"),
            "trainer_errors": sum(1 for r in trainer if r["event"] == "error"),
            "max_rss_mib": {k: round(v / 2**20) for k, v in sorted(self.rss.items())},
            "violations": self.violations,
        }


def near_kill(t: float, kills: list[float]) -> bool:
    """Whether a write confirmed at ``t`` may have been lost to a master's failover:
    confirmed at most ``FAILOVER_WINDOW_S`` before a master was SIGKILLed."""
    return any(0 <= kill - t <= FAILOVER_WINDOW_S for kill in kills)


def llm_verdicts(llm: dict, master_kills: list[float]) -> list[str]:
    """The violations in the LLM check's result (``check-llm`` of tests/soak/roles.py), which
    it completes with what the faults explain: a rewarded trajectory missing a turn is lost
    to a master's failover when confirmed at most ``FAILOVER_WINDOW_S`` before one. A
    refused reward always is one: the gateway spools every call it answers before the reply
    goes back, and a gateway restarted on its spool records what a SIGKILLed one left (also
    the turns it held unconfirmed while a promoted shard had no replica)."""
    lost = [t for t, at in llm.pop("missing_at").items() if near_kill(at, master_kills)]
    llm["lost_to_failover"] = lost
    out = [f"llm: {p}" for p in llm["problems"]]
    for traj, why in llm["refused_rewards"].items():
        out.append(f"llm: the reward of {traj} refused: {why['error']}")
    unexplained = sorted(set(llm["missing"]) - set(lost))
    if unexplained:
        out.append(f"llm: rewarded turns not stored: {unexplained[:20]}")
    adm = llm["admission"]
    if adm["open"] or adm["waiting"]:
        out.append(f"llm: admission still in flight at the end: {adm}")
    if adm["admitted"] > llm["trained_slots"]:
        out.append(
            f"llm: {adm['admitted'] - llm['trained_slots']} admission slots leaked "
            f"(admitted {adm['admitted']}, trained {llm['trained_slots']})"
        )
    return out


def recovery_line(faults: list[dict]) -> str:
    """Per paradigm, the worst and median seconds to serve again after a heal."""
    parts = []
    for paradigm in PARADIGMS_LOGS:
        got = sorted(
            f["recovery"][paradigm]
            for f in faults
            if f.get("recovery", {}).get(paradigm) is not None
        )
        if got:
            parts.append(f"{paradigm} max {got[-1]:.1f} s, median {got[len(got) // 2]:.1f} s")
    return "recovery per paradigm: " + "; ".join(parts)


def report(result: dict) -> str:
    s = result["store"]
    lines = [
        f"chaos soak: {result['minutes']:g} min, seed {result['seed']}",
        f"faults: {len(result['faults'])}",
    ]
    if "times" in result:
        t = result["times"]
        lines.append(f"deployed in {t['deployment_s']:g} s, checked in {t['checks_s']:g} s")
    for f in result["faults"]:
        what = " ".join(f"{k}={v}" for k, v in f.items() if k not in ("at", "kind"))
        lines.append(f"  {f['at']:7.1f} s  {f['kind']:<13} {what}")
    rec = [f["recovery_s"] for f in result["faults"] if f.get("recovery_s") is not None]
    if rec:
        lines.append(f"recovery: max {max(rec):.1f} s, median {sorted(rec)[len(rec) // 2]:.1f} s")
    lines += [
        f"off-policy: {s['confirmed_episodes']} episodes ({s['confirmed_steps']} steps) "
        f"confirmed; missing {s['n_missing']}, partial {s['n_partial']}, doubled "
        f"{s['n_doubled']}; {s['stored_steps']} steps stored; lost to a master's failover: "
        f"{len(s['lost_to_failover'])} {s['lost_to_failover'][:5]}",
        f"archive: {s['archived_rows']} rows, {s['archive_doubles']} doubled; "
        f"dead letters: {s['dead_letters']} {s['dead_letter_reasons'] or ''}",
        f"on-policy: {result['onpolicy']['rollouts']} rollouts, "
        f"{result['onpolicy']['minibatches']} minibatches, "
        f"{result['onpolicy']['n_problems']} problems",
        f"trainer: {result['batches']} batches, {result['trainer_errors']} errors",
        *paradigm_lines(result),
        recovery_line(result["faults"]),
        "max RSS (MiB): " + ", ".join(f"{k} {v}" for k, v in result["max_rss_mib"].items()),
        f"violations: {len(result['violations'])}",
        *(f"  {v}" for v in result["violations"]),
    ]
    return "\n".join(lines)


def paradigm_lines(result: dict) -> list[str]:
    j, g, n, llm = result["joint"], result["grpo"], result["nearest"], result["llm"]
    adm = llm["admission"]
    return [
        f"joint: {j['confirmed_episodes']} episodes confirmed, {j['batches']} batches, "
        f"{j['rows']} rows, {j['n_problems']} problems",
        f"llm: {llm['answered_calls']} calls answered, {llm['rewarded_trajectories']} "
        f"trajectories rewarded ({llm['turns_of_rewarded']} turns), "
        f"{len(llm['refused_rewards'])} rewards refused, {llm['unanswered_turns']} turns "
        "recorded unanswered, "
        f"{len(llm['missing'])} rewarded with a turn missing ({len(llm['lost_to_failover'])} "
        f"lost to a master's failover), {llm['n_problems']} problems",
        f"grpo: {g['batches']} batches to v {g['version']}, {g['n_problems']} stale; "
        f"admission at the end: admitted {adm['admitted']} (trained {llm['trained_slots']}), "
        f"open {adm['open']}, waiting {adm['waiting']}, released {adm['released']}, "
        f"expired {adm['expired']}, lapsed {adm['lapsed']}",
        f"nearest: {n['answers']} answers, {n['n_problems']} problems",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.soak.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--report", type=Path, help="write the result as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument(
        "--ingest-replicas",
        type=int,
        default=1,
        help="CLAW_INGEST_REPLICAS of the workers (0: confirmed before a replica has it)",
    )
    args = p.parse_args(argv)
    # A SIGTERM (a CI timeout, ^C's cousin) still removes the hosts and their processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = unavailable()
    if why is not None:
        print(f"soak: cannot run: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="claw-soak-"))
    os.chmod(work, 0o755)
    result = Soak(args.minutes, args.seed, work, replicas=args.ingest_replicas).run()
    text = report(result)
    print(text)
    if args.report:
        args.report.write_text(json.dumps(result, indent=2))
    if args.keep or result["violations"]:
        print(f"logs: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())

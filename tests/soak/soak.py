"""The chaos soak: Claw spread over simulated hosts (tests/soak/hosts.py) while a seeded
schedule of faults runs, judged from the outside at the end.

Topology (one network namespace per host, each with its own ``/dev/shm``):

- ``a``, ``b``, ``c``: the store, a 3-master Redis Cluster with one replica per master on
  another host (``redis-cli --cluster create --cluster-replicas 1`` places them);
- ``c``: the broker (a standalone Redis, which also keeps beat's schedule) and beat, its
  schedule shortened (eviction every 10 s, archival every 60 s);
- ``b``, ``c``: a worker each (ingest, prefetch, maintenance);
- ``d``, ``e``: actors recording CartPole episodes;
- ``f``: a trainer popping a replay recipe (inline over TCP: no shared memory across hosts).

Faults, drawn from ``--seed`` and printed before they run: SIGKILL of a worker, of beat,
of the trainer (each restarted), of a cluster master (its replica takes over; the node
comes back as a replica), and partitions of an actor's, a worker's, the trainer's or a
store host's link, 5-20 s each.

Verdicts (tests/soak/roles.py ``check``): every episode an actor saw confirmed is stored
once and whole (the workers confirm a commit once a replica has it:
``CLAW_INGEST_REPLICAS=1``, ``--ingest-replicas``); no step stored twice; the archive
holds no step twice; after each fault heals, the trainer gets a batch and every actor a
confirmation within ``RECOVERY_S``;
every long-lived process stays under ``RSS_BOUND``; ``claw doctor`` is clean. The report
(one page, and JSON with ``--report``) lists the faults, counts, recovery times and the
largest RSS; the exit status is 1 on any violation.

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
from tests.soak.roles import check_rollouts
from tests.support.paths import ROOT

RECOVERY_S = 120.0
"""How soon after a fault heals the trainer must get a batch and each actor a confirmation."""
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
url, offpolicy, onpolicy = sys.argv[1:4]
Store(url, offpolicy).create(capacity=400_000, n_shards=3)
Store(url, onpolicy).create(capacity=200_000, n_shards=3, schema=Schema.rollout((4,)))
"""


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
        f = net["f"]
        f.check_output([PY, "-c", CREATE, self.url, self.ns, self.ns + "-ppo"])
        for host in (b, c):
            queues = "ingest,prefetch,maintenance"
            argv = worker_argv(queues, 2, name=f"soak-{host.name}", lone=True, heartbeat=False)
            self._add(f"worker-{host.name}", host, argv)
            wait_for(
                lambda h=host: b"ready." in self.procs[f"worker-{h.name}"].log.read_bytes(),
                "a worker starts",
                timeout=180,
            )
        self._add("beat", c, celery_argv("beat", "-S", "redbeat.RedBeatScheduler", "-l", "INFO"))
        stop, ppo = str(self.stop_file), self.ns + "-ppo"
        for i, host in enumerate((net["d"], net["e"])):
            log = str(self.work / f"actor-{host.name}.jsonl")
            seed = str(self.seed * 10 + i)
            self._role(f"actor-{host.name}", host, "actor", self.ns, host.name, log, stop, seed)
            log = str(self.work / f"rollout-actor-{host.name}.jsonl")
            role = f"rollout-actor-{host.name}"
            self._role(role, host, "rollout-actor", ppo, host.name, log, stop, str(i + 1))
        self._role("trainer", f, "trainer", self.ns, str(self.work / "trainer.jsonl"), stop)
        log = str(self.work / "ppo-trainer.jsonl")
        self._role("ppo-trainer", f, "ppo-trainer", ppo, log, stop)

    def _role(self, role: str, host: Host, name: str, ns: str, *args: str) -> None:
        """A role of tests/soak/roles.py on ``host``."""
        self._add(role, host, [PY, "-m", "tests.soak.roles", name, self.url, ns, *args])

    def _add(self, role: str, host: Host, argv: list[str]) -> None:
        self.procs[role] = Proc(role, host, argv, self.work / f"{role}.log", dict(self.env)).start()

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
        if kind in ("kill-worker", "kill-beat", "kill-trainer"):
            role = {"kill-beat": "beat", "kill-trainer": fault.get("trainer")}.get(
                kind, f"worker-{fault.get('host')}"
            )
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

    def recovered(self, since: float) -> float | None:
        """Seconds until the trainer got a batch and each actor a confirmation after
        ``since``; None past ``RECOVERY_S``."""
        logs = [
            self.work / "trainer.jsonl",
            self.work / "ppo-trainer.jsonl",
            *(self.work / f"{role}-{h}.jsonl" for role in ("actor", "rollout-actor") for h in "de"),
        ]
        events = ["batch", "minibatch", *["confirmed"] * 4]

        def first_after(path: Path, event: str) -> float | None:
            if not path.exists():
                return None
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["event"] == event and rec["t"] > since:
                    return rec["t"]
            return None

        deadline = since + RECOVERY_S
        while time.time() < deadline:
            got = [first_after(p, e) for p, e in zip(logs, events, strict=True)]
            if all(t is not None for t in got):
                return max(got) - since  # type: ignore[type-var,operator]
            time.sleep(0.5)
        return None

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
            near = any(0 <= kill - t <= FAILOVER_WINDOW_S for kill in self.master_kills)
            (lost if near else unexplained).append(episode)
        return lost, unexplained

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
                self.up(net)
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
                    fault.update(
                        duration_s=round(healed - t0, 1), recovery_s=took and round(took, 1)
                    )
                    self.faults.append(fault)
                    if took is None:
                        self.violations.append(f"no recovery within {RECOVERY_S:g} s: {fault}")
                    print(f"  done {json.dumps(fault)}")
                    sys.stdout.flush()
                rest = start + self.minutes * 60 - time.time()
                if rest > 0:
                    time.sleep(rest)
                return self.finish()
            finally:
                self._sampling = False
                for proc in [*self.procs.values(), *self.nodes]:
                    proc.kill()

    def finish(self) -> dict:
        self.stop_file.touch()
        roles = ["trainer", "ppo-trainer"]
        roles += [f"{r}-{h}" for r in ("actor", "rollout-actor") for h in "de"]
        for role in roles:
            popen = self.procs[role].popen
            assert popen is not None
            try:
                popen.wait(300)
            except subprocess.TimeoutExpired:
                self.violations.append(f"{role} did not stop within 300 s")
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
        trainer = [json.loads(x) for x in (self.work / "trainer.jsonl").read_text().splitlines()]
        for role, rss in self.rss.items():
            if rss > RSS_BOUND:
                self.violations.append(f"{role}: RSS {rss / 2**20:.0f} MiB > bound")
        return {
            "minutes": self.minutes,
            "seed": self.seed,
            "faults": self.faults,
            "store": result,
            "onpolicy": onpolicy,
            "batches": sum(1 for r in trainer if r["event"] == "batch"),
            "trainer_errors": sum(1 for r in trainer if r["event"] == "error"),
            "max_rss_mib": {k: round(v / 2**20) for k, v in sorted(self.rss.items())},
            "violations": self.violations,
        }


def report(result: dict) -> str:
    s = result["store"]
    lines = [
        f"chaos soak: {result['minutes']:g} min, seed {result['seed']}",
        f"faults: {len(result['faults'])}",
    ]
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
        "max RSS (MiB): " + ", ".join(f"{k} {v}" for k, v in result["max_rss_mib"].items()),
        f"violations: {len(result['violations'])}",
        *(f"  {v}" for v in result["violations"]),
    ]
    return "\n".join(lines)


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

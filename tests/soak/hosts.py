"""Simulated hosts on one machine, for tests that need Claw spread over several machines.

Each host is a Linux network namespace with its own ``/dev/shm`` tmpfs (a mount namespace
held by an anchor process), so Claw's processes there see another host: another address,
and another ``/dev/shm`` device, which is what :func:`orchestrator.delivery.shm.host_id`
tells hosts apart by. The hosts are joined by a bridge that lives in a namespace of its own
(``<prefix>-sw``): nothing is added to the machine's own network, and the addresses
(``10.213.<net>.0/24``) exist only inside these namespaces.

A partition takes a host's port on the bridge down (``ip link set ... down``); healing
brings it up. The kernel here has no ``netem``: a delay, if a test wants one, is a
userspace proxy.

Making namespaces needs root and ``ip``, ``unshare`` and ``nsenter``; :func:`unavailable`
says why they cannot be made, and the tests skip with that reason.

    with Network(["a", "b"]) as net:
        server = net["a"].run(["redis-server", "--bind", net["a"].addr, ...], log=...)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

TOOLS = ("ip", "unshare", "nsenter", "mount")


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network and mount namespaces)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} on PATH"
    probe = f"clawprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


class Host:
    """One simulated host: its namespace, address and anchor (the holder of its mounts)."""

    def __init__(self, network: Network, name: str, index: int) -> None:
        self.network, self.name, self.index = network, name, index
        self.ns = f"{network.prefix}-{name}"
        self.addr = f"10.213.{network.net}.{index + 1}"
        self.port = f"{network.prefix}{index}"  # its end on the bridge (in the switch)
        self.anchor: subprocess.Popen | None = None
        self.shm_size = network.shm_size

    def _up(self) -> None:
        sw = self.network.switch
        _ip("netns", "add", self.ns)
        _ip("link", "add", "eth0", "netns", self.ns, "type", "veth", "peer", self.port, ns=sw)
        _ip("link", "set", self.port, "master", "br0", "up", ns=sw)
        _ip("addr", "add", f"{self.addr}/24", "dev", "eth0", ns=self.ns)
        _ip("link", "set", "eth0", "up", ns=self.ns)
        _ip("link", "set", "lo", "up", ns=self.ns)
        # The anchor holds the host's mount namespace: a private /dev/shm tmpfs that every
        # process of this host shares (and no process of another host sees).
        script = (
            f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm && "
            "echo ready && exec sleep infinity"
        )
        self.anchor = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.ns,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.anchor.stdout is not None
        line = self.anchor.stdout.readline().strip()
        if line != "ready":
            err = self.anchor.stderr.read() if self.anchor.stderr else ""
            raise RuntimeError(f"host {self.name}: its /dev/shm could not be mounted: {err}")

    def argv(self, argv: Sequence[str], cwd: str | Path | None = None) -> list[str]:
        """``argv`` run on this host (its network and mounts), in ``cwd`` (default: this
        process's; entering a mount namespace would otherwise start it in ``/``)."""
        assert self.anchor is not None, "the network is not up"
        wd = f"--wd={cwd if cwd is not None else os.getcwd()}"
        return ["nsenter", "-t", str(self.anchor.pid), "--net", "--mount", wd, "--", *argv]

    def run(
        self,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` on this host in its own process group (output to ``log``)."""
        out: IO[bytes] | int = log.open("ab") if log is not None else subprocess.DEVNULL
        return subprocess.Popen(
            self.argv(argv, cwd),
            env={**os.environ, **(env or {})},
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def check_output(self, argv: Sequence[str], timeout: float = 60.0) -> str:
        """``argv``'s output on this host; a failure raises with its stderr's tail."""
        done = subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(
                f"on host {self.name}, {' '.join(argv)[:300]} exited {done.returncode}:\n"
                f"{done.stderr[-3000:]}"
            )
        return done.stdout

    def partition(self) -> None:
        """Cut this host off the bridge (its own processes keep running)."""
        _ip("link", "set", self.port, "down", ns=self.network.switch)

    def heal(self) -> None:
        _ip("link", "set", self.port, "up", ns=self.network.switch)

    def _down(self) -> None:
        if self.anchor is not None and self.anchor.poll() is None:
            self.anchor.kill()
            self.anchor.wait()
        # Processes still inside the namespace would keep it: end them first.
        pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


class Network:
    """Simulated hosts joined by one bridge; a context manager that removes them all."""

    def __init__(self, names: Iterable[str], *, shm_size: str = "512m") -> None:
        self.net = os.getpid() % 250 + 1  # the /24 (each network is apart: overlaps are fine)
        self.prefix = f"cw{secrets.token_hex(3)}"  # names no other run uses
        self.switch = f"{self.prefix}-sw"
        self.shm_size = shm_size
        self.hosts = {name: Host(self, name, i) for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Self:
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for host in self.hosts.values():
                host._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for host in self.hosts.values():
            host._down()
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)

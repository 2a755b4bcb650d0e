"""Hosts as Linux network namespaces on one machine, for cross-host tests and benchmarks.

    with NetnsHosts(["a", "b", "c"]) as hosts:     # root only (NetnsUnavailable otherwise)
        hosts.ip("a")                             # 10.R.S.1: addresses this harness assigns
        proc = hosts.spawn("b", [sys.executable, "-m", "kvcake", ...])
        hosts.limit("b", rate_mbit=200)           # tbf on both directions of b's link
    # every process spawned is killed (by PID), every namespace, veth and the bridge deleted

Each host is a namespace with one veth pair to a bridge in the root namespace; the bridge has an
address too, so the test process reaches every host. Addresses come from a private /24 in
10.0.0.0/8 that no route of this machine uses. Processes run in their own UTS namespace with the
host's name as hostname: kvcake's same-host test (hostname + boot id) then tells the hosts apart,
so KV and store bytes cross between them over TCP, never through shared memory.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any


class NetnsUnavailable(RuntimeError):
    """Not root, or `ip` / `unshare` missing: the caller skips with this message."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def _free_subnet() -> str:
    used = _run("ip", "-4", "route", "show").stdout + _run("ip", "-4", "addr", "show").stdout
    rng = random.Random(os.getpid())
    for _ in range(200):
        prefix = f"10.{rng.randrange(100, 250)}.{rng.randrange(1, 250)}"
        if f"{prefix}." not in used:
            return prefix
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet for the test hosts")


def check_available() -> None:
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (the CI runs this test as root)")
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"`{tool}` is missing: apt-get install iproute2 util-linux")


class NetnsHosts:
    def __init__(self, names: Sequence[str], log_dir: Path | None = None) -> None:
        self.names = list(names)
        self.tag = f"k{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.subnet = ""
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), to delete

    def ns(self, host: str) -> str:
        return f"{self.tag}{host}"

    def ip(self, host: str) -> str:
        return f"{self.subnet}.{self.names.index(host) + 1}"

    @property
    def root_ip(self) -> str:
        return f"{self.subnet}.254"

    def _veth(self, host: str) -> str:
        return f"{self.tag}{host}v"

    def start(self) -> NetnsHosts:
        check_available()
        self.subnet = _free_subnet()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _run("ip", "addr", "add", f"{self.root_ip}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for host in self.names:
                ns, veth = self.ns(host), self._veth(host)
                _run("ip", "netns", "add", ns)
                self._made.append(("netns", ns))
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
                self._made.append(("link", veth))
                _run("ip", "link", "set", veth, "master", self.bridge)
                _run("ip", "link", "set", veth, "up")
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(host)}/24",
                     "dev", "eth0")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            self.close()
            raise NetnsUnavailable(f"could not build the test hosts: {detail.strip()}") from None
        return self

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host`: its network namespace, its own UTS namespace and hostname."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', f"{self.tag}-{host}", *argv]

    def spawn(self, host: str, argv: Sequence[str], name: str | None = None,
              **popen: Any) -> subprocess.Popen[bytes]:
        """Start `argv` on `host` (stdout+stderr to `log_dir/<name>.log` when a log_dir is
        set, else to this process's stderr). The process is killed by `close()`."""
        if self.log_dir is not None and "stdout" not in popen:
            log = open(self.log_dir / f"{name or host}.log", "ab")  # noqa: SIM115
            self._logs.append(log)
            popen.setdefault("stdout", log)
            popen.setdefault("stderr", subprocess.STDOUT)
        proc = subprocess.Popen(self.command(host, argv), **popen)
        self.processes.append(proc)
        return proc

    def limit(self, host: str, rate_mbit: float | None) -> None:
        """Cap both directions of `host`'s link at `rate_mbit` (a token bucket; None: lift it).
        (netem delay is not used: many kernels, this CI's among them, lack sch_netem.)"""
        ends = [[], ["ip", "netns", "exec", self.ns(host)]]
        devs = [self._veth(host), "eth0"]
        for prefix, dev in zip(ends, devs, strict=True):
            if rate_mbit is None:
                _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                continue
            burst_bytes = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # >= 4 ms of traffic
            _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                 f"{rate_mbit}mbit", "burst", str(burst_bytes), "latency", "200ms")

    def close(self) -> None:
        self.stop_processes()
        for kind, name in reversed(self._made):
            if kind == "netns":
                _run("ip", "netns", "del", name, check=False)
            else:
                _run("ip", "link", "del", name, check=False)
        self._made.clear()

    def stop_processes(self) -> None:
        # Last started first (clients before their servers), SIGTERM: they unregister and
        # free their shared memory; SIGKILL what is still there after 10 s.
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.processes.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> NetnsHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

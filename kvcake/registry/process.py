"""`EtcdProcess`: a real single-member `etcd` in a temporary directory, on free ports, for tests
and benchmarks (production runs etcd as a service: docs/cluster.md).

    with EtcdProcess() as etcd:      # raises EtcdMissing when no `etcd` binary is installed
        Etcd(etcd.endpoint) ...
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvcake.registry.etcd import Etcd, EtcdUnavailable

PORT_TRIES = 3


class EtcdMissing(RuntimeError):
    """No `etcd` binary on PATH."""


class _PortTaken(Exception):
    """etcd could not bind a port picked for it: another process took it first."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EtcdProcess:
    def __init__(self, host: str = "127.0.0.1", binary: str = "etcd",
                 start_timeout_s: float = 20.0, prefix: list[str] | None = None) -> None:
        """`prefix` runs the binary through another command (e.g. `ip netns exec NS`)."""
        self.host = host
        self.binary = binary
        self.prefix = prefix or []
        self.start_timeout_s = start_timeout_s
        self.client_port = 0
        self.peer_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self) -> EtcdProcess:
        """Start etcd on two free ports. A port is picked free and bound by etcd a moment
        later: if another process took it meanwhile, etcd exits and is started again on new
        ports (up to `PORT_TRIES` times)."""
        path = shutil.which(self.binary)
        if path is None:
            raise EtcdMissing(f"no `{self.binary}` binary on PATH: install etcd "
                              "(Debian: apt-get install etcd-server)")
        for attempt in range(1, PORT_TRIES + 1):
            try:
                return self._start_once(path)
            except _PortTaken:
                if attempt == PORT_TRIES:
                    raise RuntimeError(f"etcd did not start: its ports were taken by others "
                                       f"{PORT_TRIES} times") from None
        raise AssertionError("unreachable")

    def _start_once(self, path: str) -> EtcdProcess:
        self._dir = tempfile.TemporaryDirectory(prefix="kvcake-etcd-")
        # Picked on this namespace's loopback: a fresh namespace (`prefix`) has them free too.
        self.client_port, self.peer_port = free_port(), free_port()
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        log = open(Path(self._dir.name) / "etcd.log", "wb")  # noqa: SIM115 (closed with the dir)
        self.process = subprocess.Popen(
            [*self.prefix, path, "--name", "kvcake", "--data-dir", str(Path(self._dir.name) / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvcake={peer}", "--log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        probe = Etcd(self.endpoint, timeout_s=1.0)
        while True:
            try:
                probe.status()
                if self.process.poll() is None:  # ours answered, not whoever took the port
                    return self
            except EtcdUnavailable:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                text = self.log_text()
                self.close()
                if self.client_port == self.peer_port or "address already in use" in text:
                    raise _PortTaken
                raise RuntimeError(f"etcd did not start on {self.endpoint}: {text[-2000:]}")
            time.sleep(0.05)

    def log_text(self) -> str:
        if self._dir is None:
            return ""
        path = Path(self._dir.name) / "etcd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

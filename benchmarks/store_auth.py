"""The cluster-secret handshake: what it costs per connection, and that puts and gets do not pay
it per operation. Two stores side by side in one run, identical but for the secret:

  open:    `kvcake store master` + `kvcake store node` (no secret: today's default)
  secret:  the same two processes with `--secret-file` (the client proves the same secret)

This script is the client, over TCP (no shared memory). Measured, rounds interleaved, best of
`--rounds` for each figure (the machine is shared):
  connect: a new master connection plus one `stats` round trip, `--connects` times (the
           handshake is one extra round trip and two HMACs per connection)
  put/get: 64 KiB x 400 and 1 MiB x 100 objects through one long-lived client (the master
           link and the node's segment connections are opened once, then reused); the script
           also counts the client's handshakes during them

    .venv/bin/python benchmarks/store_auth.py [--rounds 3] [--connects 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.store import StoreClient
from kvcake.store.remote import RemoteMaster
from kvcake.transfer import TransferConfig

STORE = [sys.executable, "-m", "kvcake.store"]
SIZES = {"64KiB": (64 << 10, 400), "1MiB": (1 << 20, 100)}
GB = 1e9
HANDSHAKES = [0]  # client-side handshakes made (counted by wrapping auth.authenticate)
_authenticate = auth.authenticate


def _counted(sock: Any, secret: ClusterSecret | None, context: bytes,
             timeout_s: float = auth.HANDSHAKE_TIMEOUT_S) -> None:
    if secret is not None:
        HANDSHAKES[0] += 1
    _authenticate(sock, secret, context, timeout_s)


auth.authenticate = _counted  # RpcConnection and TcpTransport call it through the module


def _wait_for(proc: subprocess.Popen[str], pattern: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(pattern, line)
        if match:
            return match.group(1)
    raise RuntimeError(f"process exited before printing {pattern!r}")


class Store:
    """One master and one node (each its own process), with or without the secret file."""

    def __init__(self, secret_file: Path | None) -> None:
        flags = ["--secret-file", str(secret_file)] if secret_file else []
        self.procs: list[subprocess.Popen[str]] = []
        master = self._spawn("master", "--port", "0", "--no-node", *flags)
        self.address = _wait_for(master, r"master listening on (\S+)")
        node = self._spawn("node", "--master", self.address, "--dram", "512MiB", "--rails", "1",
                           *flags)
        _wait_for(node, r"node (\S+) joined")

    def _spawn(self, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([*STORE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait(timeout=30)


def connect_us(address: str, secret: ClusterSecret | None, num: int) -> float:
    """Microseconds per new master connection + one stats round trip."""
    start = time.perf_counter()
    for _ in range(num):
        master = RemoteMaster(address, secret=secret)
        master.stats()
        master.close()
    return (time.perf_counter() - start) / num * 1e6


def put_get(client: StoreClient, tag: str, size: int, count: int) -> dict[str, float]:
    data = os.urandom(size)
    keys = [f"{tag}-{size}-{i}" for i in range(count)]
    start = time.perf_counter()
    for key in keys:
        client.put(key, data)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for key in keys:
        client.get(key)
    get_s = time.perf_counter() - start
    for key in keys:
        client.remove(key)
    return {"put_ops": count / put_s, "get_ops": count / get_s,
            "put_gbps": count * size / put_s / GB, "get_gbps": count * size / get_s / GB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connects", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    secret = ClusterSecret.generate()
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        secret.write(secret_file)
        stores = {"open": Store(None), "secret": Store(secret_file)}
        secrets_of = {"open": None, "secret": secret}
        best: dict[str, dict[str, float]] = {name: {} for name in stores}
        handshakes = {name: 0 for name in stores}
        try:
            clients = {name: StoreClient(s.address, transfer_config=TransferConfig(
                serve=False, use_shared_memory=False, num_rails=1, secret=secrets_of[name]))
                for name, s in stores.items()}
            for round_ in range(args.rounds):
                order = list(stores) if round_ % 2 == 0 else list(reversed(stores))
                for name in order:  # interleaved, each first in turn: the same load for both
                    store = stores[name]
                    figures = {"connect_us": connect_us(store.address, secrets_of[name],
                                                        args.connects)}
                    before = HANDSHAKES[0]
                    for label, (size, count) in SIZES.items():
                        for key, value in put_get(clients[name], f"r{round_}", size,
                                                  count).items():
                            figures[f"{label}_{key}"] = value
                    handshakes[name] += HANDSHAKES[0] - before
                    for key, value in figures.items():
                        keep = min if key == "connect_us" else max
                        best[name][key] = keep(best[name].get(key, value), value)
            for client in clients.values():
                client.close()
        finally:
            for store in stores.values():
                store.close()
    print(f"{'figure':<18} {'open':>10} {'secret':>10} {'secret/open':>12}")
    for key in best["open"]:
        o, s = best["open"][key], best["secret"][key]
        print(f"{key:<18} {o:>10.1f} {s:>10.1f} {s / o:>12.3f}")
    ops = args.rounds * sum(2 * count for _, count in SIZES.values())
    print(f"handshakes during {ops} puts and gets per store: open {handshakes['open']}, "
          f"secret {handshakes['secret']} (the first connections of the long-lived client)")
    if args.json:
        Path(args.json).write_text(json.dumps({"best": best, "handshakes": handshakes},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

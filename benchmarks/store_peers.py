"""The peers `store_vs_peers.py` measures ours against, each a system with the same calls
(`putget`, `batch`, `stop`): Redis (redis-server, the redis client in this process) and the
Mooncake store (a master, a storage worker and a client worker, in the Mooncake venv that
`../shared/tools/peers/mooncake_store_setup.sh` builds); and what a run needs of this machine
(`missing_peers`), asked before any server starts; and the helpers this script and
`store_latency.py` start and stop servers with (`wait_port`, `wait_registered`, `terminate`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

MOONCAKE_VENV = Path(os.environ.get("MOONCAKE_VENV", "/tmp/mooncake-venv"))

MOONCAKE_WORKER = r'''
import ctypes, json, sys, time
from mooncake.store import MooncakeDistributedStore
role, master_port, segment, local_buffer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", f"http://127.0.0.1:{master_port + 1}/metadata", segment,
                 local_buffer, "tcp", "", f"127.0.0.1:{master_port}")
print(json.dumps({"ready": rc == 0, "rc": rc}), flush=True)
if role == "storage":
    sys.stdin.read()  # hold the segment until the benchmark closes our stdin
    sys.exit(0)
for line in sys.stdin:
    cmd = json.loads(line)
    keys = [f"{cmd['prefix']}-{i}" for i in range(cmd["n"])]
    value = bytes([7]) * cmd["size"]
    out = {}
    if cmd["op"] == "putget":
        t0 = time.perf_counter()
        bad = sum(store.put(k, value) != 0 for k in keys)
        t1 = time.perf_counter()
        got = [store.get(k) for k in keys]
        t2 = time.perf_counter()
        out = {"put_s": t1 - t0, "get_s": t2 - t1, "put_errors": bad,
               "get_ok": all(g == value for g in got)}
    elif cmd["op"] == "batch":
        bad = sum(store.put(k, value) != 0 for k in keys)
        t0 = time.perf_counter()
        got = store.get_batch(keys)  # new bytes objects
        t1 = time.perf_counter()
        ok = all(g == value for g in got)
        # into buffers allocated, touched and registered before the clock starts
        total = cmd["n"] * cmd["size"]
        buf = (ctypes.c_char * total)()
        base = ctypes.addressof(buf)
        ctypes.memset(base, 1, total)
        registered = store.register_buffer(base, total) == 0
        ptrs = [base + i * cmd["size"] for i in range(cmd["n"])]
        t2 = time.perf_counter()
        sizes = store.batch_get_into(keys, ptrs, [cmd["size"]] * cmd["n"])
        t3 = time.perf_counter()
        view = memoryview(buf).cast("B")
        ok_into = registered and list(sizes) == [cmd["size"]] * cmd["n"] and all(
            view[i * cmd["size"]:(i + 1) * cmd["size"]] == value for i in range(cmd["n"]))
        store.unregister_buffer(base)
        out = {"batch_get_s": t1 - t0, "batch_get_into_s": t3 - t2, "put_errors": bad,
               "get_ok": ok and ok_into}
    for k in keys:
        store.remove(k)
    print(json.dumps(out), flush=True)
'''


def missing_peers(skip: set[str]) -> list[str]:
    """What the peers not in `skip` need and this machine lacks, each as what to do about it."""
    missing = []
    if "redis" not in skip:
        if shutil.which("redis-server") is None:
            missing.append("redis-server: apt-get install redis-server (or --skip redis)")
        if importlib.util.find_spec("redis") is None:
            missing.append("the redis client: .venv/bin/pip install 'redis>=5' (kvcake's "
                           "`bench` extra), or --skip redis")
    if "mooncake" not in skip and not (MOONCAKE_VENV / "bin" / "mooncake_master").exists():
        missing.append(f"no Mooncake venv at {MOONCAKE_VENV}: bash "
                       "../shared/tools/peers/mooncake_store_setup.sh (or --skip mooncake)")
    return missing


class Redis:
    name = "redis"

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"], stdout=subprocess.DEVNULL)
        wait_port(self.port)
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        self.client.ping()

    def putget(self, size: int, n: int, prefix: str) -> dict[str, Any]:
        keys = [f"{prefix}-{i}" for i in range(n)]
        value = bytes([7]) * size
        t0 = time.perf_counter()
        for k in keys:
            self.client.set(k, value)
        t1 = time.perf_counter()
        got = [self.client.get(k) for k in keys]
        t2 = time.perf_counter()
        self.client.delete(*keys)
        return {"put_s": t1 - t0, "get_s": t2 - t1, "get_ok": all(g == value for g in got)}

    def batch(self, size: int, n: int, prefix: str) -> dict[str, Any]:
        keys = [f"{prefix}-{i}" for i in range(n)]
        value = bytes([7]) * size
        self.client.mset({k: value for k in keys})
        t0 = time.perf_counter()
        got = self.client.mget(keys)
        t1 = time.perf_counter()
        self.client.delete(*keys)
        return {"batch_get_s": t1 - t0, "get_ok": all(g == value for g in got)}

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)


class Mooncake:
    name = "mooncake"

    def __init__(self, port: int) -> None:
        self.port = port
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, logs: Path) -> None:
        python = MOONCAKE_VENV / "bin" / "python"
        master = MOONCAKE_VENV / "bin" / "mooncake_master"
        if not python.exists() or not master.exists():
            raise RuntimeError(f"no Mooncake venv at {MOONCAKE_VENV}: run "
                               "../shared/tools/peers/mooncake_store_setup.sh")
        self.procs.append(subprocess.Popen(
            [str(master), "--port", str(self.port), "--enable_http_metadata_server=true",
             "--http_metadata_server_host", "127.0.0.1",
             "--http_metadata_server_port", str(self.port + 1)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(self.port)
        wait_port(self.port + 1)
        worker = logs / "mooncake_worker.py"
        worker.write_text(MOONCAKE_WORKER)
        self.storage = self._worker(python, worker, "storage", 2 << 30, 16 << 20)
        self.client = self._worker(python, worker, "client", 0, 1 << 30)

    def _worker(self, python: Path, script: Path, role: str, segment: int,
                buffer: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([str(python), str(script), role, str(self.port), str(segment),
                                 str(buffer)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or '{"ready": false}')
        if not ready.get("ready"):
            raise RuntimeError(f"Mooncake {role} setup failed: {ready}")
        return proc

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(json.dumps(cmd) + "\n")
        self.client.stdin.flush()
        return dict(json.loads(self.client.stdout.readline()))

    def putget(self, size: int, n: int, prefix: str) -> dict[str, Any]:
        return self._ask({"op": "putget", "size": size, "n": n, "prefix": prefix})

    def batch(self, size: int, n: int, prefix: str) -> dict[str, Any]:
        return self._ask({"op": "batch", "size": size, "n": n, "prefix": prefix})

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            terminate(proc)


def wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")


def terminate(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def wait_registered(address: str, timeout_s: float = 120.0) -> None:
    """Until the master at `address` has a node registered."""
    from kvcake.store.remote import RemoteMaster

    master = RemoteMaster(address)
    try:
        deadline = time.monotonic() + timeout_s
        while not master.stats()["nodes"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no node registered with {address} in {timeout_s:.0f} s")
            time.sleep(0.05)
    finally:
        master.close()

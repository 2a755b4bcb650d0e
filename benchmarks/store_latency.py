"""Where a small store operation's time goes: one put and one get, stage by stage, next to a bare
Python TCP round trip and Redis's SET and GET of the same size, on loopback, in one run.

    .venv/bin/python benchmarks/store_latency.py [--size 65536] [--ops 300] [--port 21300]

Ours is `kvcake store master` + `kvcake store node` (separate processes, as in
store_vs_peers.py), this script the client over TCP. A put is timed as its three stages (put_start
at the master, the write at the node, the acknowledged commit at the master) and whole; a get as
its two (the master's descriptor and lease, the node read; the lease release rides with the next
request) and whole; a slot put as its two (the write into a slot reserved ahead, then one master
request that commits it and reserves the next) and whole; a whole get with the location cache
(the node read alone) and without it. Redis: `redis-server` from Debian through redis-py (skipped if either is
missing). Every figure is the median (p50) over `--ops` operations, after a warm-up, in us.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from store_peers import wait_port, wait_registered  # benchmarks/, this script's directory

from kvcake.store import StoreClient
from kvcake.store.layout import HEADER_BYTES, payload_checksum
from kvcake.store.master_api import unwrap
from kvcake.store.replica_io import segment_of, valid
from kvcake.transfer import TransferConfig, TransferOp, TransferRequest


def _p50_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _timed(fn: Callable[[int], Any], ops: int) -> list[float]:
    out = []
    for i in range(ops):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def bare_round_trip(ops: int) -> float:
    """p50 of a 20-byte echo between this process and a forked one over loopback TCP."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    pid = os.fork()
    if pid == 0:  # the echo side
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(100):
            conn.sendall(data)
        os._exit(0)
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def echo(_: int) -> bytes:
        sock.sendall(b"x" * 20)
        return sock.recv(100)

    try:
        _timed(echo, 100)
        return _p50_us(_timed(echo, ops))
    finally:
        sock.close()
        listener.close()
        os.waitpid(pid, 0)


def redis_latency(size: int, ops: int, port: int) -> dict[str, float] | None:
    try:
        import redis
    except ImportError:
        return None
    try:
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    except FileNotFoundError:
        return None
    try:
        wait_port(port)
        client = redis.Redis(host="127.0.0.1", port=port)
        value = bytes([7]) * size
        _timed(lambda i: client.set(f"w{i}", value), 50)
        put = _timed(lambda i: client.set(f"k{i}", value), ops)
        get = _timed(lambda i: client.get(f"k{i}"), ops)
        return {"SET": _p50_us(put), "GET": _p50_us(get)}
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def ours_latency(size: int, ops: int, port: int) -> dict[str, float]:
    procs = [subprocess.Popen([sys.executable, "-m", "kvcake.store", "master", "--port",
                               str(port), "--no-node", "--stats-interval-s", "3600"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait_port(port)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvcake.store", "node", "--master", f"127.0.0.1:{port}",
             "--dram", "1GiB", "--node-id", "bench", "--port", str(port + 1),
             "--stats-interval-s", "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(port + 1)
        wait_registered(f"127.0.0.1:{port}")  # after the segment server's start and prefault
        config = TransferConfig(serve=False, use_shared_memory=False)
        with StoreClient(f"127.0.0.1:{port}", transfer_config=config) as client:
            return _measure(client, size, ops)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=15)


def _measure(client: StoreClient, size: int, ops: int) -> dict[str, float]:
    """Stages through the client's own put and get paths (its writer, reader and transfer)."""
    value = bytes([7]) * size
    writer, reader, master = client._writer, client._reader, client.master
    stages: dict[str, list[float]] = {k: [] for k in (
        "put: put_start", "put: write", "put: commit", "get: master", "get: node read")}
    for rnd in ("warm", "timed"):
        keys = [f"{rnd}-{i}" for i in range(ops if rnd == "timed" else 50)]
        for key in keys:  # a put, stage by stage (ObjectWriter.put_batch for one key)
            t0 = time.perf_counter()
            views = [memoryview(value)]
            starts, checksums = writer._put_start([[key, size]], views, None, None)
            t1 = time.perf_counter()
            requests, digests = writer._put_requests(
                [(key, views[0], checksums[0], unwrap(starts[0]))])
            client._transfer(requests, digests)
            t2 = time.perf_counter()
            for item in master.put_commit_batch([[key, checksums[0]]]):
                unwrap(item)
            t3 = time.perf_counter()
            if rnd == "timed":
                for name, dt in zip(("put: put_start", "put: write", "put: commit"),
                                    (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    stages[name].append(dt)
        scratch = memoryview(bytearray(HEADER_BYTES + size))
        for key in keys:  # a get, stage by stage (ObjectReader.get's direct case)
            t0 = time.perf_counter()
            meta = master.get(key)
            t1 = time.perf_counter()
            replica = meta["replicas"][0]
            client._transfer([TransferRequest(TransferOp.READ, scratch,
                                              segment_of(replica["segment"]), replica["offset"])])
            if not valid(replica, meta, scratch[:HEADER_BYTES], scratch[HEADER_BYTES:]):
                raise RuntimeError(f"{key}: read back wrong bytes")
            t2 = time.perf_counter()
            reader.release([(key, meta)])
            if rnd == "timed":
                stages["get: master"].append(t1 - t0)
                stages["get: node read"].append(t2 - t1)
        client.remove_batch(keys)
    shape, reserve = (size, None, None), [size, 1, None, None]
    slot_stages: dict[str, list[float]] = {"slot put: write": [], "slot put: put_slots": []}
    for rnd in ("warm", "timed"):  # a slot put, stage by stage (ObjectWriter.put)
        keys = [f"slot-{rnd}-{i}" for i in range(ops if rnd == "timed" else 50)]
        for key in keys:
            slot = writer._take(shape)
            if slot is None:
                writer._keep(shape, master.put_slots([], reserve)["slots"])
                slot = writer._take(shape)
            assert slot is not None
            t0 = time.perf_counter()
            view = memoryview(value)
            checksum = payload_checksum(view)
            requests, digests = writer._put_requests([(key, view, checksum, slot["replicas"])])
            client._transfer(requests, digests)
            t1 = time.perf_counter()
            result = master.put_slots([[key, slot["slot"], size, checksum]], reserve)
            unwrap(result["results"][0])
            writer._keep(shape, result["slots"])
            t2 = time.perf_counter()
            if rnd == "timed":
                slot_stages["slot put: write"].append(t1 - t0)
                slot_stages["slot put: put_slots"].append(t2 - t1)
        client.remove_batch(keys)
    stages.update(slot_stages)
    out = {name: _p50_us(samples) for name, samples in stages.items()}
    whole_keys = [f"whole-{i}" for i in range(ops)]
    out["put (whole, slot)"] = _p50_us(_timed(lambda i: client.put(whole_keys[i], value), ops))
    out["get (whole, cached location)"] = _p50_us(_timed(lambda i: client.get(whole_keys[i]),
                                                         ops))
    reader.forget(whole_keys)
    out["get (whole, from the master)"] = _p50_us(_timed(lambda i: client.get(whole_keys[i]),
                                                         ops))
    client.remove_batch(whole_keys)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64 << 10, help="object bytes")
    parser.add_argument("--ops", type=int, default=300, help="operations per figure")
    parser.add_argument("--port", type=int, default=21300, help="ours: port, port + 1; Redis: + 5")
    args = parser.parse_args(argv)
    if args.size < 1 or args.ops < 1:
        parser.error("--size and --ops must be >= 1")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average "
          f"{os.getloadavg()[0]:.1f}; {args.size} bytes, p50 over {args.ops} ops, us", flush=True)
    print(f"bare Python TCP round trip (20 bytes)   {bare_round_trip(args.ops):8.0f}", flush=True)
    redis = redis_latency(args.size, args.ops, args.port + 5)
    if redis is None:
        print("redis: skipped (no redis-server or no redis-py)")
    else:
        for name, value in redis.items():
            print(f"redis {name:34s}{value:8.0f}")
    for name, value in ours_latency(args.size, args.ops, args.port).items():
        print(f"ours {name:35s}{value:8.0f}")
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

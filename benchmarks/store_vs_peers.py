"""Our store vs Redis vs the real Mooncake store, side by side in one run, on loopback.

The same layout for every system: one storage process, one client process that puts and gets.
  ours:     "ours-tcp" (the default deployment): `kvcake store master` as it starts by default,
            hosting a store node of 1 GiB in its process (store/hosted.py, store/cli.py; one
            storage process, like redis-server), default client over TCP: a single put is one
            request (`put_inline`: the master's process receives the bytes into the node's
            segment, checks their xxh3-64, commits; acknowledged).
            "ours-tcp-no-node": `kvcake store master --no-node` (metadata only, as
            mooncake_master) + `kvcake store node --dram 2GiB` (the storage process), default
            client over TCP: a small put writes into a reserved slot on the node, then commits
            at the master (two round trips); "ours-tcp-no-node-fwd" with the opt-in
            `forward_puts=True` (store/forward.py: one request to the node, which checks the
            bytes' xxh3-64, commits at the master and relays the acknowledgement). The same
            two processes serve three more rows: over
            the node's shared-memory segment ("ours-shm", same host, no TCP at all), over TCP
            with `StoreClient(async_seal=True)` ("ours-tcp-seal": a small put returns once its
            one-way seal is sent, not acknowledged; writer.py) and over TCP with the client's
            location cache off ("ours-tcp-nocache": `location_cache=0`; every get asks the master
            first). The default client remembers where the objects it wrote or read live and
            reads them without asking the master, still checked by version, xxh3-64 and the
            node's revocation mark (reader.py, master.py: linearizable with removes and
            evictions).
  redis:    `redis-server` (Debian), this script is the client through redis-py
  mooncake: `mooncake_master` + a Mooncake client process holding a segment (storage) + a second,
            pure Mooncake client process that puts and gets (PyPI
            mooncake-transfer-engine-non-cuda in its own venv, set up by
            ../shared/tools/peers/mooncake_store_setup.sh), TCP protocol
Objects of 64 KiB, 1 MiB, 16 MiB: put and get GB/s and ops/s; batch get of 64 x 1 MiB measured
like with like both ways: returning new `bytes` (ours `get_batch`, Redis `mget`, Mooncake
`get_batch`) and into buffers allocated before the clock starts (ours `get_batch_into`, Mooncake
`batch_get_into` into a registered buffer; Redis has no such call); and the
transfer engine alone (benchmarks/transfer_bench.py). Systems take turns for `--rounds` rounds
and each keeps its best figure (the machine is shared; interleaving gives all the same chances).
Each round starts one system later in the list (`turn_order`): a system measured right after
another inherits what that one left behind (a peer's background work after its phase, the
allocator's state after its freed buffers), so no system always follows the same one.

    .venv/bin/python benchmarks/store_vs_peers.py [--rounds 3] [--port 21100] [--json out.json]

The peers themselves (how each is started, driven and stopped) are in `store_peers.py`.

Ports used: --port .. --port+19 (ours, redis, mooncake) and 21800.. (transfer engine alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
sys.path.insert(0, str(ROOT / "benchmarks"))

from store_peers import Mooncake, Redis, missing_peers, terminate, wait_port, wait_registered  # noqa: E402

from kvcake.store import StoreClient  # noqa: E402
from kvcake.transfer import TransferConfig  # noqa: E402

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
COUNTS = {64 << 10: 400, 1 << 20: 100, 16 << 20: 16}  # objects per measurement
BATCH = 64
GB = 1e9

class Ours:
    node_flags: tuple[str, ...] = ()  # flags for every node we start (--no-prefault)

    def __init__(self, name: str, port: int, shm: bool, async_seal: bool = False,
                 location_cache: int | None = None, hosted: bool = False,
                 forward_puts: bool = False) -> None:
        self.name, self.port, self.shm, self.async_seal = name, port, shm, async_seal
        self.forward_puts = forward_puts
        self.hosted = hosted
        self.location_cache = location_cache
        self.procs: list[subprocess.Popen[Any]] = []
        self.client: StoreClient | None = None
        self.address = ""

    def start(self, logs: Path, shared: Ours | None = None) -> None:
        """`logs`: the run's directory for the master's and node's output."""
        if shared is not None:  # the second row uses the same master and node
            address = shared.address
        elif self.hosted:  # the default: the master hosts a node (store/hosted.py, cli.py)
            log = open(logs / f"{self.name}-hosted.log", "w")  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvcake.store", "master", "--port", str(self.port),
                 "--node-id", "bench-hosted", "--node-port", str(self.port + 1),
                 "--stats-interval-s", "3600", *self.node_flags], stdout=log,
                stderr=subprocess.STDOUT))
            address = f"127.0.0.1:{self.port}"
            wait_port(self.port)
            wait_port(self.port + 1)
        else:
            log = open(logs / f"{self.name}-master.log", "w")  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvcake.store", "master", "--port", str(self.port),
                 "--no-node", "--stats-interval-s", "3600"], stdout=log,
                stderr=subprocess.STDOUT))
            address = f"127.0.0.1:{self.port}"
            wait_port(self.port)
            node_log = open(logs / f"{self.name}-node.log", "w")  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvcake.store", "node", "--master", address, "--dram",
                 "2GiB", "--node-id", "bench", "--port", str(self.port + 1), "--rails", "4",
                 "--stats-interval-s", "3600", *self.node_flags], stdout=node_log,
                stderr=subprocess.STDOUT))
            wait_port(self.port + 1)
            wait_registered(address)  # after the segment server's start (and its prefault)
        self.address = address
        config = TransferConfig(serve=False, use_shared_memory=self.shm, num_rails=4)
        options: dict[str, Any] = {"async_seal": self.async_seal,
                                   "forward_puts": self.forward_puts}
        if self.location_cache is not None:  # None: the client's default
            options["location_cache"] = self.location_cache
        self.client = StoreClient(address, transfer_config=config, **options)

    def putget(self, size: int, n: int, prefix: str) -> dict[str, Any]:
        assert self.client is not None
        keys = [f"{prefix}-{i}" for i in range(n)]
        value = bytes([7]) * size
        t0 = time.perf_counter()
        for k in keys:
            self.client.put(k, value)
        t1 = time.perf_counter()
        got = [self.client.get(k) for k in keys]
        t2 = time.perf_counter()
        buffer = bytearray(size)
        for k in keys:
            self.client.get_into(k, buffer)
        t3 = time.perf_counter()
        ok = all(g == value for g in got) and buffer == value
        self.client.remove_batch(keys)
        return {"put_s": t1 - t0, "get_s": t2 - t1, "get_into_s": t3 - t2, "get_ok": ok}

    def batch(self, size: int, n: int, prefix: str) -> dict[str, Any]:
        assert self.client is not None
        keys = [f"{prefix}-{i}" for i in range(n)]
        value = bytes([7]) * size
        self.client.put_batch(keys, [value] * n)
        t0 = time.perf_counter()
        got = self.client.get_batch(keys)  # new bytes objects
        t1 = time.perf_counter()
        buffers = [bytearray(size) for _ in keys]  # allocated (and zeroed) before the clock
        t2 = time.perf_counter()
        sizes = self.client.get_batch_into(keys, buffers)
        t3 = time.perf_counter()
        self.client.remove_batch(keys)
        ok = got == [value] * n and sizes == [size] * n and all(b == value for b in buffers)
        return {"batch_get_s": t1 - t0, "batch_get_into_s": t3 - t2, "get_ok": ok}

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        for proc in reversed(self.procs):
            terminate(proc)


def turn_order(systems: list[T], round_index: int) -> list[T]:
    """The systems in round `round_index`'s order: the list rotated by the round's index, so
    the first to go (and the one after each system) changes from round to round."""
    shift = round_index % len(systems) if systems else 0
    return systems[shift:] + systems[:shift]


def measure(systems: list[Any], rounds: int) -> dict[str, dict[str, float]]:
    """{system: {metric: best value}}; metrics are GB/s and ops/s."""
    best: dict[str, dict[str, float]] = {s.name: {} for s in systems}

    def keep(system: str, metric: str, value: float) -> None:
        best[system][metric] = max(best[system].get(metric, 0.0), value)

    for r in range(rounds):
        order = turn_order(systems, r)
        for label, size in SIZES.items():
            n = COUNTS[size]
            for system in order:
                out = system.putget(size, n, f"r{r}-{label}")
                if not out.get("get_ok") or out.get("put_errors"):
                    raise RuntimeError(f"{system.name} returned wrong bytes or failed: {out}")
                for op in ("put", "get", "get_into"):
                    if f"{op}_s" in out:
                        keep(system.name, f"{label}.{op}.gbps", n * size / out[f"{op}_s"] / GB)
                        keep(system.name, f"{label}.{op}.ops", n / out[f"{op}_s"])
        for system in order:
            out = system.batch(1 << 20, BATCH, f"r{r}-batch")
            if not out.get("get_ok"):
                raise RuntimeError(f"{system.name} batch get returned wrong bytes: {out}")
            for op in ("get", "get_into"):
                if f"batch_{op}_s" in out:
                    seconds = out[f"batch_{op}_s"]
                    keep(system.name, f"batch64x1MiB.{op}.gbps", BATCH * (1 << 20) / seconds / GB)
                    keep(system.name, f"batch64x1MiB.{op}.ops", BATCH / seconds)
    return best


def report(best: dict[str, dict[str, float]]) -> str:
    peers = [p for p in ("redis", "mooncake") if p in best]
    ours = [s for s in best if s.startswith("ours")]
    metrics = [f"{label}.{op}" for label in SIZES for op in ("put", "get")] + [
        "batch64x1MiB.get", "batch64x1MiB.get_into"]
    head = f"{'metric':18s}" + "".join(f"{s:>20s}" for s in [*ours, *peers])
    head += "".join(f"{s + ' / best peer':>24s}" for s in ours)
    lines = ["GB/s (ops/s)", head]
    for metric in metrics:
        row = f"{metric:18s}"
        for system in [*ours, *peers]:
            gbps = best[system].get(f"{metric}.gbps")
            ops = best[system].get(f"{metric}.ops")
            row += f"{'n/a':>20s}" if gbps is None else f"{gbps:8.3f} ({ops:8.0f})".rjust(20)
        peer_best = max((best[p].get(f"{metric}.gbps", 0.0) for p in peers), default=0.0)
        for system in ours:
            value = best[system].get(f"{metric}.gbps")
            ratio = f"{value / peer_best:.2f}x" if value and peer_best else "n/a"
            row += f"{ratio:>24s}"
        lines.append(row)
    lines.append("batch64x1MiB.get: new bytes objects (ours get_batch, Redis mget, Mooncake "
                 "get_batch); batch64x1MiB.get_into: into buffers allocated before the clock "
                 "(ours get_batch_into, Mooncake batch_get_into; Redis has no such call)")
    for system in ours:
        extra = [f"{label} {best[system][f'{label}.get_into.gbps']:.3f}" for label in SIZES
                 if f"{label}.get_into.gbps" in best[system]]
        if extra:
            lines.append(f"{system} get_into (zero-copy into a caller buffer) GB/s: "
                         + ", ".join(extra))
    return "\n".join(lines)


def transfer_alone(port: int) -> str:
    try:
        from transfer_bench import format_report, run_transfer_benchmarks
    except ImportError as exc:  # the transfer engineer's benchmark is not there
        return f"TODO transfer engine alone: benchmarks/transfer_bench.py unavailable ({exc})"
    result = run_transfer_benchmarks(size_bytes=64 << 20, duration_s=1.0, port=port, rounds=2)
    return str(format_report(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=21100, help="base port (uses 20 ports)")
    parser.add_argument("--transfer-port", type=int, default=21800)
    parser.add_argument("--skip", default="",
                        help="comma list of: redis, mooncake, transfer, seal, nocache, "
                        "forward, no-node (the no-node deployment's rows: "
                        "ours-tcp-no-node, ours-shm, seal, nocache, forward)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--no-prefault", action="store_true",
                        help="our nodes do not make their segments resident at start "
                             "(kvcake store node --no-prefault), to measure what that costs puts")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    missing = missing_peers(skip)
    if missing:  # before any server starts
        print("store_vs_peers: missing peers:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 2
    if args.no_prefault:
        Ours.node_flags = ("--no-prefault",)
    ours_tcp = Ours("ours-tcp", args.port, shm=False, hosted=True)  # the default deployment
    no_node = args.port + 3  # `master --no-node` + `node`: the next rows share its processes
    ours_no_node = Ours("ours-tcp-no-node", no_node, shm=False)
    ours_shm = Ours("ours-shm", no_node, shm=True)
    ours_seal = Ours("ours-tcp-seal", no_node, shm=False, async_seal=True)
    ours_nocache = Ours("ours-tcp-nocache", no_node, shm=False, location_cache=0)
    # the opt-in forwarded put (store/forward.py): one request to the node, which commits
    ours_forwarded = Ours("ours-tcp-no-node-fwd", no_node, shm=False, forward_puts=True)
    systems: list[Any] = []
    started: list[Any] = []
    # The servers' logs (and Mooncake's worker script): removed after a clean run, kept (and
    # named) when the run fails.
    logs = Path(tempfile.mkdtemp(prefix="store_vs_peers-"))
    clean = False
    try:
        # each system is listed before it starts: a start that fails half way (its server up,
        # its client refused) is still stopped
        started.append(ours_tcp)
        ours_tcp.start(logs)
        systems.append(ours_tcp)
        if "no-node" not in skip:
            started.append(ours_no_node)
            ours_no_node.start(logs)
            started.append(ours_shm)
            ours_shm.start(logs, shared=ours_no_node)
            systems += [ours_no_node, ours_shm]
            for row, name in ((ours_seal, "seal"), (ours_nocache, "nocache"),
                              (ours_forwarded, "forward")):
                if name not in skip:
                    started.append(row)
                    row.start(logs, shared=ours_no_node)
                    systems.append(row)
        if "redis" not in skip:
            redis = Redis(args.port + 5)
            started.append(redis)
            redis.start()
            systems.append(redis)
        if "mooncake" not in skip:
            mooncake = Mooncake(args.port + 10)
            started.append(mooncake)
            mooncake.start(logs)
            systems.append(mooncake)
        print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} interleaved rounds, best "
              "of each", flush=True)
        best = measure(systems, args.rounds)
        clean = True
    finally:
        for system in reversed(started):
            system.stop()
        if clean:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print(f"run failed: the servers' logs are kept in {logs}", file=sys.stderr)
    print(report(best))
    if "transfer" not in skip:
        print(transfer_alone(args.transfer_port))
    print(f"load average after {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(best, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a small put's CPU goes: CPU per put of the client, the master and the node.

Starts `kvcake store master --no-node` and `kvcake store node` as separate processes (the
`ours-tcp-no-node` row of benchmarks/store_vs_peers.py) or, with `--hosted`, `kvcake store
master` as it starts by default, hosting its node (the `ours-tcp` row; its CPU is reported as
the master's, the node's is 0), then this process puts `--n` objects of `--size`
bytes with the default client over TCP, `--rounds` times after one warm-up round (each round's
keys are removed before the next, so later rounds reuse freed ranges: the steady state). Per
round: wall time per put, this client's user and system CPU per put (`os.times`), and the
master's and node's (`/proc/PID/stat`, clock ticks: 10 ms, so use `--n` of a few thousand).
No peer runs here: it measures our three processes only, to compare two versions of our code
(run it once per version, alternating; `PYTHONPATH=DIR` picks the `kvcake` package in DIR;
a version from before `--no-node` existed starts its master without a node by default: give
it `--old-cli`).

    .venv/bin/python benchmarks/store_put_cpu.py [--n 2000] [--size 65536] [--rounds 3] [--hosted]
                                                 [--forward]

Ports used: --port and --port+1. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kvcake
from kvcake.store import StoreClient
from kvcake.transfer import TransferConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_vs_peers import _terminate, _wait_port, _wait_registered  # noqa: E402

_TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


def cpu_us(pid: int) -> tuple[float, float]:
    """(user, system) CPU of process `pid` so far, in microseconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) * _TICK_US, int(fields[12]) * _TICK_US


def start(port: int, logs: Path, hosted: bool, old_cli: bool = False
          ) -> list[subprocess.Popen[Any]]:
    """A master and a node, started and registered as store_vs_peers.py starts them; `hosted`:
    the master only, hosting its node (the node's process is the master's)."""
    master_log = open(logs / "master.log", "w")  # noqa: SIM115
    if hosted:
        flags = ["--with-node", "1GiB"] if old_cli else []
        procs = [subprocess.Popen([sys.executable, "-m", "kvcake.store", "master", "--port",
                                   str(port), "--node-port", str(port + 1), *flags,
                                   "--stats-interval-s", "3600"],
                                  stdout=master_log, stderr=subprocess.STDOUT)]
        _wait_port(port)
        _wait_port(port + 1)
        return procs * 2  # the node's CPU is the master's: reported there, 0 for the node
    flags = [] if old_cli else ["--no-node"]
    procs = [subprocess.Popen([sys.executable, "-m", "kvcake.store", "master", "--port",
                               str(port), *flags, "--stats-interval-s", "3600"],
                              stdout=master_log, stderr=subprocess.STDOUT)]
    _wait_port(port)
    node_log = open(logs / "node.log", "w")  # noqa: SIM115
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "kvcake.store", "node", "--master", f"127.0.0.1:{port}", "--dram",
         "2GiB", "--node-id", "bench", "--port", str(port + 1), "--rails", "4",
         "--stats-interval-s", "3600"], stdout=node_log, stderr=subprocess.STDOUT))
    _wait_port(port + 1)
    _wait_registered(f"127.0.0.1:{port}")
    return procs


def put_round(client: StoreClient, procs: list[subprocess.Popen[Any]], value: bytes, n: int,
              prefix: str) -> dict[str, float]:
    """Put `n` new keys, then remove them; microseconds per put of each measure."""
    keys = [f"{prefix}-{i}" for i in range(n)]
    master0, node0 = cpu_us(procs[0].pid), cpu_us(procs[1].pid)
    times0, wall0 = os.times(), time.perf_counter()
    for key in keys:
        client.put(key, value)
    wall1, times1 = time.perf_counter(), os.times()
    master1, node1 = cpu_us(procs[0].pid), cpu_us(procs[1].pid)
    if procs[0] is procs[1]:  # hosted: one process, counted once
        node0 = node1
    client.remove_batch(keys)
    return {"wall": (wall1 - wall0) * 1e6 / n,
            "client_user": (times1.user - times0.user) * 1e6 / n,
            "client_sys": (times1.system - times0.system) * 1e6 / n,
            "master_user": (master1[0] - master0[0]) / n, "master_sys": (master1[1] - master0[1]) / n,
            "node_user": (node1[0] - node0[0]) / n, "node_sys": (node1[1] - node0[1]) / n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="puts per round")
    parser.add_argument("--size", type=int, default=64 << 10, help="bytes per object")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    parser.add_argument("--port", type=int, default=23600)
    parser.add_argument("--hosted", action="store_true",
                        help="the default deployment: `kvcake store master` hosting its node")
    parser.add_argument("--forward", action="store_true",
                        help="the client forwards its puts through the node (opt-in "
                        "ClientConfig.forward_puts=True, store/forward.py: one request to the "
                        "node, which commits at the master); without it: bytes to the node, "
                        "then the commit to the master, two round trips")
    parser.add_argument("--old-cli", action="store_true",
                        help="the kvcake measured predates --no-node (its master hosts no node "
                        "unless --with-node)")
    args = parser.parse_args(argv)
    if args.n < 1 or args.size < 0 or args.rounds < 1:
        parser.error("--n and --rounds must be >= 1, --size >= 0")
    print(f"kvcake from {Path(kvcake.__file__).parent.parent}; {args.size} bytes x {args.n} "
          f"puts; {'hosted' if args.hosted else '--no-node'}"
          f"{', forwarded' if args.forward else ''}; us per put", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvcake-put-cpu-") as logs:
        procs = start(args.port, Path(logs), args.hosted, args.old_cli)
        try:
            config = TransferConfig(serve=False, use_shared_memory=False, num_rails=4)
            options = {"forward_puts": True} if args.forward else {}
            with StoreClient(f"127.0.0.1:{args.port}", transfer_config=config,
                             **options) as client:
                value = bytes([7]) * args.size
                put_round(client, procs, value, args.n, "warm")
                for r in range(args.rounds):
                    m = put_round(client, procs, value, args.n, f"r{r}")
                    print(f"round {r}: wall {m['wall']:.1f}  client user {m['client_user']:.1f} "
                          f"sys {m['client_sys']:.1f}  master user {m['master_user']:.1f} sys "
                          f"{m['master_sys']:.1f}  node user {m['node_user']:.1f} sys "
                          f"{m['node_sys']:.1f}", flush=True)
        finally:
            for proc in reversed(dict.fromkeys(procs)):
                _terminate(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Socket buffer size vs transfer speed: our engine over loopback TCP with SO_SNDBUF/SO_RCVBUF
left to the kernel's autotuning (0, the default) or fixed, interleaved, in one run.

    .venv/bin/python benchmarks/transfer_socket_buffers.py [--sizes 0,262144,1048576,8388608]
        [--rails 1,4] [--reps 3] [--size-mib 256] [--port 21000]

One segment server process per buffer size (ports port, port+60, ...), the client here with a
registered (page-aligned) buffer. Prints, per setting, the median and best GB/s and the median CPU
seconds per GB moved (client + server), the steadier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time
from typing import Any

import numpy as np

from kvcake.transfer import SegmentDesc, TransferConfig, TransferEngine


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _serve(port: int, buffer_bytes: int, size_bytes: int, conn: Any) -> None:
    config = TransferConfig(port=port, port_search=50, socket_buffer_bytes=buffer_bytes)
    with TransferEngine(config) as engine:
        desc = engine.allocate_segment("bench", size_bytes)
        engine.segment("bench").array[:] = 7
        conn.send(desc.to_dict())
        while conn.recv() == "cpu":
            conn.send(_cpu_s())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,262144,1048576,8388608")
    parser.add_argument("--rails", default="1,4")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=1.2)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--port", type=int, default=21000)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    rails_list = [int(x) for x in args.rails.split(",")]
    size_bytes = args.size_mib << 20
    ctx = mp.get_context("spawn")
    servers: dict[int, tuple[Any, Any, SegmentDesc]] = {}
    load_before = os.getloadavg()[0]
    try:
        for i, buffer_bytes in enumerate(sizes):
            conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_serve, daemon=True,
                               args=(args.port + 60 * i, buffer_bytes, size_bytes, child_conn))
            proc.start()
            servers[buffer_bytes] = (conn, proc, SegmentDesc.from_dict(conn.recv()))
        results: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
        for _ in range(args.reps):
            for buffer_bytes, (conn, _, desc) in servers.items():
                for rails in rails_list:
                    config = TransferConfig(serve=False, use_shared_memory=False,
                                            num_rails=rails, socket_buffer_bytes=buffer_bytes)
                    with TransferEngine(config) as client:
                        client.allocate_segment("buffer", size_bytes, shared=False)
                        buffer = client.segment("buffer").array
                        for op in ("read", "write"):
                            step = getattr(client, op)
                            step(desc, 0, buffer)
                            conn.send("cpu")
                            cpu_before = _cpu_s() + float(conn.recv())
                            start, calls = time.perf_counter(), 0
                            while time.perf_counter() - start < args.duration_s:
                                step(desc, 0, buffer)
                                calls += 1
                            gb = calls * size_bytes / 1e9
                            conn.send("cpu")
                            cpu = _cpu_s() + float(conn.recv()) - cpu_before
                            results.setdefault((buffer_bytes, rails, op), []).append(
                                (gb / (time.perf_counter() - start), cpu / gb))
    finally:
        for conn, proc, _ in servers.values():
            conn.send("stop")
            proc.join(30)
    print(f"{args.size_mib} MiB per transfer, {args.reps} interleaved reps of "
          f"{args.duration_s} s, load avg {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| SO_SNDBUF/SO_RCVBUF | rails | op | GB/s median | GB/s best | CPU s/GB median |")
    print("|---|---|---|---|---|---|")
    for (buffer_bytes, rails, op), values in sorted(results.items()):
        rates = sorted(v[0] for v in values)
        cpus = sorted(v[1] for v in values)
        name = "autotuned (0)" if buffer_bytes == 0 else f"{buffer_bytes >> 10} KiB"
        print(f"| {name} | {rails} | {op} | {np.median(rates):.2f} | {rates[-1]:.2f} | "
              f"{np.median(cpus):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Disaggregated (+ store) vs colocated serving on the same number of workers, in one run.

    .venv/bin/python benchmarks/serving_disagg_vs_colocated.py \
        --trace ../shared/traces/conversation_trace.jsonl --max-requests 100 --speed 1 \
        --scale-tokens 0.03125 --capacity-requests 100 --capacity-probes 5 \
        --capacity-start-speed 4      # ~6 minutes on 2 contended cores

Each system is a cluster started by `kvcake.server.cluster.launcher` (worker processes, the same
frontend, the same Conductor code): (a) 1 prefill + 1 decode worker with the store (policy
global_cache), (b) 2 colocated workers (policy colocated: local prefix cache only, no store).
`kvcake bench` replays the same scaled slice of the trace against each, twice: a cold pass
(empty caches and store) and a warm pass (the same prompts again: prefixes in the store and the
local caches). Then, on the same warm cluster, `kvcake bench --find-capacity` searches the
highest replay speed (and request rate) at which >= 90% of requests are effective, over the first
`--capacity-requests` records with at most `--capacity-probes` probes (each a full replay: the
cap keeps the whole run bounded). Printed: effective request capacity, TTFT and the paper's TBT
per pass, the capacity found, the ratios disaggregated / colocated, and the KV streaming overlap
measured by the prefill workers.
Admission control is off in both (every request is served), so the capacity compares the
systems and not the Conductor's rejections.

Then the direct path's two same-host transports side by side (`--transport-requests`, 0 skips
it): one decode worker process (its KV pool in shared memory) and, in this process, prefill
workers that write into its reserved blocks by memcpy through the shared memory ("shm") or over
loopback TCP with per-slice digests ("tcp": `shared_memory=False`, the path every same-host
write took while the pool was private memory), layer by layer and after the prefill, requests
alternating between them: exposed transfer time per request and the decode process's CPU time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvcake.conductor import Admission, ConductorConfig
from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.frontend.api import ApiServer, create_app

FIELDS = ("completed", "failed", "effective_request_capacity", "mean_ttft_ms", "p90_ttft_ms",
          "mean_tbt_ms", "p90_tbt_ms", "mean_tpot_ms", "request_throughput")


def bench(url: str, args: argparse.Namespace, find_capacity: bool = False) -> dict[str, Any]:
    max_requests, speed = args.max_requests, args.speed
    extra: list[str] = []
    if find_capacity:
        max_requests, speed = args.capacity_requests, args.capacity_start_speed
        extra = ["--find-capacity", "--max-capacity-probes", str(args.capacity_probes)]
    cmd = [sys.executable, "-m", "kvcake", "bench", "--trace", str(args.trace), "--url", url,
           "--max-requests", str(max_requests), "--speed", str(speed),
           "--scale-tokens", str(args.scale_tokens), "--tbt-slo-ms", str(args.tbt_slo_ms),
           "--ttft-slo-s", str(args.ttft_slo_s), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    report: dict[str, Any] = json.loads(out)
    return report


def run_system(name: str, config: ClusterConfig, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[{name}] starting {len(config.workers)} workers", file=sys.stderr, flush=True)
    with Cluster(config) as cluster:
        assert cluster.backend is not None
        api = ApiServer(create_app(cluster.backend), port=args.port)
        api.start()
        try:
            passes = {}
            for label in ("cold", "warm"):
                started = time.perf_counter()
                passes[label] = bench(api.url, args)
                print(f"[{name}] {label} pass: {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
            capacity = None
            if args.capacity_probes > 0:
                started = time.perf_counter()
                capacity = bench(api.url, args, find_capacity=True)["capacity"]
                print(f"[{name}] capacity search: {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
            totals = cluster.backend.totals
            streaming = {"num_prefills": totals.num_prefills,
                         "kv_stream_hidden_share": totals.hidden_share,
                         "prefill_compute_s": totals.compute_s,
                         "transfer_span_s": totals.transfer_span_s,
                         "transfer_exposed_s": totals.transfer_exposed_s,
                         "transfer_bytes": totals.transfer_bytes,
                         "cached_tokens": totals.num_cached_tokens,
                         "fetched_tokens": totals.num_fetched_tokens}
        finally:
            api.close()
    return {"passes": passes, "capacity": capacity, "streaming": streaming}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "traces"
                        / "conversation_trace.jsonl")
    parser.add_argument("--max-requests", type=int, default=300)
    parser.add_argument("--speed", type=float, default=2.0)
    parser.add_argument("--scale-tokens", type=float, default=1 / 32)
    parser.add_argument("--ttft-slo-s", type=float, default=30.0)
    parser.add_argument("--tbt-slo-ms", type=float, default=100.0)
    parser.add_argument("--capacity-requests", type=int, default=100,
                        help="records replayed by each --find-capacity probe")
    parser.add_argument("--capacity-probes", type=int, default=5,
                        help="probe budget of the capacity search per system (0: skip it)")
    parser.add_argument("--capacity-start-speed", type=float, default=4.0)
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: any)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--streaming-requests", type=int, default=20)
    parser.add_argument("--streaming-prompt-len", type=int, default=1500)
    parser.add_argument("--transport-requests", type=int, default=20,
                        help="requests per transport and mode in the shm / tcp comparison")
    parser.add_argument("--skip-systems", action="store_true",
                        help="run only the streaming and transport comparisons")
    args = parser.parse_args()
    if not args.trace.is_file():
        raise SystemExit(f"--trace: {args.trace} not found")
    engine = EngineConfig(kv_cache_bytes=64 * 2**20, max_num_batched_tokens=512)
    conductor = {"admission": "none"}
    worker = {"store_dram_bytes": 256 * 2**20}
    systems = {
        "disaggregated": ClusterConfig.simple(
            1, 1, engine=engine, worker=dict(worker),
            conductor=ConductorConfig.from_dict({**conductor, "policy": "global_cache"})),
        "colocated": ClusterConfig.simple(
            2, 0, mode="colocated", engine=engine, worker=dict(worker),
            conductor=ConductorConfig.from_dict({**conductor, "policy": "colocated"})),
    }
    results: dict[str, Any] = {}
    if not args.skip_systems:
        results = {name: run_system(name, config, args) for name, config in systems.items()}
        print_table(results)
    results["streaming"] = {mode: streaming_run(layerwise, engine, args)
                            for mode, layerwise in (("layerwise", True), ("after_prefill", False))}
    print_streaming(results["streaming"])
    if args.transport_requests > 0:
        results["transport"] = transport_run(engine, args)
        print_transport(results["transport"])
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=2) + "\n")
    return 0


def streaming_run(layerwise: bool, engine: EngineConfig,
                  args: argparse.Namespace) -> dict[str, float]:
    """Sequential long prompts (3 chunks each) on 1 prefill + 1 decode worker, the KV streamed
    layer by layer during the prefill or all of it after: TTFT and exposed transfer time."""
    import asyncio

    import numpy as np

    from kvcake.server.frontend.backend import GenerateRequest
    from kvcake.types import RequestId

    config = ClusterConfig.simple(1, 1, engine=engine, conductor=ConductorConfig(
        admission=Admission.NONE), worker={"layerwise": layerwise,
                                           "store_dram_bytes": 256 * 2**20})
    rng = np.random.default_rng(7)
    with Cluster(config) as cluster:
        backend = cluster.backend
        assert backend is not None

        async def one(i: int) -> float:
            prompt = tuple(rng.integers(0, 256, args.streaming_prompt_len).tolist())
            start = time.perf_counter()
            stream = await backend.generate(GenerateRequest(
                RequestId(f"s{i}"), prompt, 2, temperature=0.0, ignore_eos=True))
            first = None
            async for _ in stream:
                first = first or time.perf_counter() - start
            return first or 0.0

        ttfts = [asyncio.run(one(i)) for i in range(args.streaming_requests)]
        t = backend.totals
        return {"mean_ttft_ms": 1000 * float(np.mean(ttfts)),
                "exposed_ms_per_request": 1000 * t.transfer_exposed_s / t.num_prefills,
                "compute_ms_per_request": 1000 * t.compute_s / t.num_prefills,
                "mib_per_request": t.transfer_bytes / t.num_prefills / 2**20,
                "hidden_share": t.hidden_share}


def print_streaming(runs: dict[str, dict[str, float]]) -> None:
    for mode, r in runs.items():
        print(f"streaming {mode:13s}: mean TTFT {r['mean_ttft_ms']:.1f} ms, exposed transfer "
              f"{r['exposed_ms_per_request']:.2f} ms of {r['mib_per_request']:.2f} MiB per request"
              f" (prefill compute {r['compute_ms_per_request']:.1f} ms, hidden share "
              f"{r['hidden_share']:.1%})")


def transport_run(engine: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    """See the module docstring: per (mode, transport), mean exposed transfer, transfer window
    and prefill compute per request, and the decode process's CPU per request (one warm-up
    request per prefill worker is not counted)."""
    import os

    import numpy as np

    from kvcake.server.cluster.launcher import worker_argv
    from kvcake.server.worker.config import Role, WorkerConfig
    from kvcake.server.worker.messages import MessageLink
    from kvcake.server.worker.worker import Worker

    decode_cfg = WorkerConfig(role=Role.DECODE, engine=engine, worker_id="bench-d",
                              num_threads=1)
    decode = subprocess.Popen(worker_argv(decode_cfg, os.getpid()), stdout=subprocess.PIPE,
                              text=True)
    assert decode.stdout is not None
    ready = decode.stdout.readline().split()
    if ready[:3] != ["kvcake", "worker", "ready"]:
        decode.kill()
        raise SystemExit(f"decode worker did not start: {ready}")
    d_link = MessageLink.connect(ready[4])  # a worker serves one link: shared by all runs
    runs = {(mode, kind): _Prefiller(Worker(WorkerConfig(
                role=Role.PREFILL, engine=engine, worker_id=f"bench-p-{mode}-{kind}",
                num_threads=1, layerwise=mode == "layerwise", shared_memory=kind == "shm"))
                .start(), d_link, decode.pid)
            for mode in ("layerwise", "after_prefill") for kind in ("shm", "tcp")}
    rng = np.random.default_rng(11)
    try:
        for i in range(args.transport_requests + 1):
            for run in runs.values():
                run.one(f"t{i}", rng.integers(0, 256, args.streaming_prompt_len).tolist(), i > 0)
        return {f"{mode}/{kind}": run.summary() for (mode, kind), run in runs.items()}
    finally:
        for run in runs.values():
            run.close()
        d_link.close()
        decode.terminate()
        decode.wait(timeout=30)


class _Prefiller:
    """One in-process prefill worker, its link, and the link to the decode worker process."""

    SAMPLING = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}

    def __init__(self, worker: Any, decode_link: Any, decode_pid: int) -> None:
        from kvcake.server.worker.messages import MessageLink

        self.worker, self.d, self.decode_pid = worker, decode_link, decode_pid
        self.p = MessageLink.connect(worker.address)
        self.done: list[Any] = []
        self.decode_cpu_s = 0.0

    def one(self, rid: str, prompt: list[int], counted: bool) -> None:
        from kvcake.server.worker.messages import (
            Abort,
            KvReserved,
            PrefillDone,
            PrefillOrder,
            ReserveKv,
        )

        rid = f"{self.worker.worker_id}-{rid}"
        cpu_before = _cpu_s(self.decode_pid)
        self.d.send(ReserveKv(rid, prompt, self.SAMPLING))
        reserved = _next_of(self.d, KvReserved)
        self.p.send(PrefillOrder(rid, prompt, self.SAMPLING, [], reserved.kv_pool,
                                 reserved.block_ids, reserved.num_pool_blocks))
        done = _next_of(self.p, PrefillDone)
        self.d.send(Abort(rid))  # the prefill waited for its writes: nothing writes them now
        if counted:
            self.done.append(done)
            self.decode_cpu_s += _cpu_s(self.decode_pid) - cpu_before

    def summary(self) -> dict[str, float]:
        n = len(self.done)
        return {"requests": n,
                "exposed_ms": 1000 * sum(d.transfer_exposed_s for d in self.done) / n,
                "span_ms": 1000 * sum(d.transfer_span_s for d in self.done) / n,
                "compute_ms": 1000 * sum(d.compute_s for d in self.done) / n,
                "mib": sum(d.transfer_bytes for d in self.done) / n / 2**20,
                "decode_cpu_ms": 1000 * self.decode_cpu_s / n}

    def close(self) -> None:
        self.p.close()
        self.worker.close()


def _next_of(link: Any, kind: type) -> Any:
    """The next message of `kind` on `link` (reports in between skipped); exits on a failure."""
    from kvcake.server.worker.messages import RequestFailed

    while True:
        message = link.recv()
        if message is None or isinstance(message, RequestFailed):
            raise SystemExit(f"transport comparison: {message!r}")
        if isinstance(message, kind):
            return message


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    import os

    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_transport(runs: dict[str, dict[str, float]]) -> None:
    for name, r in runs.items():
        print(f"transport {name:19s}: exposed {r['exposed_ms']:.2f} ms, window "
              f"{r['span_ms']:.1f} ms, prefill compute {r['compute_ms']:.1f} ms, decode CPU "
              f"{r['decode_cpu_ms']:.1f} ms per request of {r['mib']:.2f} MiB "
              f"({r['requests']:.0f} requests)")
    for mode in ("layerwise", "after_prefill"):
        shm, tcp = runs[f"{mode}/shm"], runs[f"{mode}/tcp"]
        ratio = tcp["exposed_ms"] / shm["exposed_ms"] if shm["exposed_ms"] else float("inf")
        print(f"{mode}: exposed transfer tcp / shm = {ratio:.2f}")


def print_table(results: dict[str, Any]) -> None:
    disagg, coloc = results["disaggregated"]["passes"], results["colocated"]["passes"]
    print(f"{'metric':28s} {'pass':5s} {'disagg':>10s} {'colocated':>10s} {'ratio':>7s}")
    for label in ("cold", "warm"):
        for key in FIELDS:
            a, b = disagg[label][key], coloc[label][key]
            ratio = f"{a / b:7.2f}" if b else "      -"
            print(f"{key:28s} {label:5s} {a:10.3f} {b:10.3f} {ratio}")
    for name in ("disaggregated", "colocated"):
        cold, warm = results[name]["passes"]["cold"], results[name]["passes"]["warm"]
        print(f"{name}: mean TTFT warm / cold = {warm['mean_ttft_ms']:.1f} / "
              f"{cold['mean_ttft_ms']:.1f} ms = {warm['mean_ttft_ms'] / cold['mean_ttft_ms']:.2f}")
    print_capacity(results)
    s = results["disaggregated"]["streaming"]
    print(f"KV streaming: {s['transfer_bytes'] / 2**20:.1f} MiB over {s['num_prefills']} prefills;"
          f" hidden behind compute {s['kv_stream_hidden_share']:.1%} (exposed "
          f"{s['transfer_exposed_s'] * 1000:.1f} ms of a {s['transfer_span_s'] * 1000:.1f} ms "
          f"window; prefill compute {s['prefill_compute_s'] * 1000:.0f} ms); fetched from the "
          f"store {s['fetched_tokens']} of {s['cached_tokens']} reused tokens")


def print_capacity(results: dict[str, Any]) -> None:
    found = {name: results[name]["capacity"] for name in ("disaggregated", "colocated")}
    if any(c is None for c in found.values()):
        return
    for name, cap in found.items():
        probes = ", ".join(f"{p['speed']:.3g}x -> {p['effective_request_capacity']:.2f}"
                           for p in cap["probes"])
        rate = cap["best_request_rate"]
        print(f"{name}: capacity (>= {cap['target_effective_share']:.0%} effective) at speed "
              f"{cap['best_speed']} = {'-' if rate is None else f'{rate:.2f}'} req/s "
              f"(probes: {probes})")
    a, b = (found[n]["best_request_rate"] for n in ("disaggregated", "colocated"))
    if a is not None and b:
        print(f"effective request capacity (req/s) disagg / colocated = {a / b:.2f}")


if __name__ == "__main__":
    sys.exit(main())

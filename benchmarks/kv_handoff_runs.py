r"""The KV hand-off's transport runs of `benchmarks/serving_disagg_vs_colocated.py --transport`
(issue 11 part 2): layer-wise vs after the prefill, shared memory vs loopback TCP.

    flock /tmp/kvcake_bench.lock .venv/bin/python benchmarks/serving_disagg_vs_colocated.py \
        --transport --transport-runs 3

Sequential long prompts (tiny preset, 1,500 tokens) on 1 prefill + 1 decode worker, the KV
streamed layer by layer during the prefill or after it (since the per-request hand-off policy,
kvcake/server/worker/handoff.py, a `layerwise = true` worker streams only the requests it
predicts pay for it; on one host over shared memory that is none of these, so the two modes'
numbers are from before that change): mean TTFT, prefill compute and exposed
transfer per request (--transport-runs repeats, alternating the modes); then the two same-host
transports (shared memory vs loopback TCP) per mode, requests alternating between them.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from typing import Any

from kvcake.conductor import Admission, ConductorConfig
from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster

TRANSPORT_ENGINE = EngineConfig(kv_cache_bytes=64 * 2**20, max_num_batched_tokens=512)


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
    from kvcake.server.worker.link import MessageLink
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
        from kvcake.server.worker.link import MessageLink

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


def transport_main(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"layerwise": [], "after_prefill": []}
    for i in range(args.transport_runs):
        order = ("layerwise", "after_prefill") if i % 2 == 0 else ("after_prefill", "layerwise")
        for mode in order:
            runs[mode].append(streaming_run(mode == "layerwise", TRANSPORT_ENGINE, args))
            print_streaming({f"{mode} #{i + 1}": runs[mode][-1]})
    net = [lw["mean_ttft_ms"] / ap["mean_ttft_ms"]
           for lw, ap in zip(runs["layerwise"], runs["after_prefill"], strict=True)]
    print(f"net TTFT layer-wise / after-prefill per run: {', '.join(f'{x:.2f}' for x in net)}")
    out: dict[str, Any] = {"streaming": runs, "net_ttft_ratio": net}
    if args.transport_requests > 0:
        out["transport"] = transport_run(TRANSPORT_ENGINE, args)
        print_transport(out["transport"])
    return out

"""Fetch vs recompute across hosts (Figure 13's question, the B/G criterion), measured live.

Root only: two hosts as network namespaces (tests/multihost/netns.py): host b runs a store master
and a store node; this process is host "a" (the root namespace, on the same bridge). The KV of a
long prefix is put into b's node once. Then, for each bandwidth of b's link (a token bucket on
both directions; no netem delay: this kernel has no sch_netem), with a fresh engine each time:

- fetch:     TTFT = read the prefix's blocks from b's store node + import them + prefill the suffix
- recompute: TTFT = prefill the whole prompt
- the Conductor (global_cache, fetch_only_if_faster; one for the whole run, its default
  bandwidth prior and estimator settings) is asked, before each fetch, to place the request with
  the prefix held by "store"; every fetch's bytes and seconds are then reported to it
  (`on_transfer_measured`, as the router does with a prefill worker's `PrefillDone`), so each
  decision rests on the estimate from the fetches before it, not on this rep's timing. Its
  prefill model: the full and suffix prefill times measured once before the first link. Does
  it fetch or recompute, and is that the faster one? (Rates run in the order given; the first
  rep at a new rate still sees the previous rate's estimate.)

    sudo .venv/bin/python benchmarks/cross_host_fetch.py --model tiny --prefix-tokens 1920 \
        --rates-mbit 25,50,100,200,400,800,0 --reps 3        # 0: no limit

Prints one line per bandwidth and a JSON summary (--json).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcake.conductor import Conductor, ConductorConfig, Placement, ScheduleRequest  # noqa: E402
from kvcake.conductor.predictor import DecodeStepPredictor  # noqa: E402
from kvcake.engine.config import EngineConfig  # noqa: E402
from kvcake.engine.engine import Engine  # noqa: E402
from kvcake.engine.sampling import SamplingParams  # noqa: E402
from kvcake.store import StoreClient  # noqa: E402
from kvcake.transfer import TransferConfig  # noqa: E402
from tests.multihost.netns import NetnsHosts, NetnsUnavailable  # noqa: E402


class MeasuredPrefill:
    """The Conductor's prefill model: the times measured in this run (recompute at prefix 0,
    suffix-only at the fetched prefix length)."""

    def __init__(self, full_s: float, suffix_s: float, prefix_len: int) -> None:
        self.full_s, self.suffix_s, self.prefix_len = full_s, suffix_s, prefix_len

    def predict(self, input_len: int, prefix_len: int) -> float:
        return self.suffix_s if prefix_len >= self.prefix_len else self.full_s


def first_token_s(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not any(out.new_token_ids for out in engine.step()):
        pass
    return time.perf_counter() - start


def wait_for(condition: object, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefix-tokens", type=int, default=1920)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--rates-mbit", default="25,50,100,200,400,800,0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show the store processes' logs")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    total = args.prefix_tokens + args.suffix_tokens
    config = EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=total)
    prompt = np.random.default_rng(0).integers(0, 256, total).tolist()
    source = Engine(args.model, config)
    first_token_s(source, prompt)  # computes the prefix's KV once
    keys = source.prompt_block_keys(prompt)[: args.prefix_tokens // source.block_size]
    blocks = [b for b in (source.export_block_kv(k) for k in keys) if b is not None]
    assert len(blocks) == len(keys), "the prefix's blocks are not all cached"
    kv_bytes = sum(len(b) for b in blocks)
    prefix_len = len(keys) * source.block_size
    try:
        hosts = NetnsHosts(["b"]).start()
    except NetnsUnavailable as exc:
        print(f"cross_host_fetch: {exc}", file=sys.stderr)
        return 2
    rows = []
    try:
        store = [sys.executable, "-m", "kvcake.store"]
        quiet: dict[str, Any] = {} if args.verbose else {
            "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        master = hosts.spawn("b", [*store, "master", "--host", hosts.ip("b"), "--port", "24500",
                                   "--no-node"],
                             **quiet)
        wait_for(lambda: _answers(f"{hosts.ip('b')}:24500") or master.poll() is not None,
                 "the store master on host b", timeout_s=120.0)
        hosts.spawn("b", [*store, "node", "--master", f"{hosts.ip('b')}:24500", "--dram",
                          f"{2 * kv_bytes + (64 << 20)}", "--host", hosts.ip("b")], **quiet)
        wait_for(lambda: _nodes(hosts) == 1 or master.poll() is not None, "the store on host b",
                 timeout_s=120.0)
        if master.poll() is not None:
            raise SystemExit("the store master on host b exited (run with --verbose)")
        client = StoreClient(f"{hosts.ip('b')}:24500", transfer_config=TransferConfig(
            serve=False, use_shared_memory=False))
        names = [f"bench:{int(k):x}" for k in keys]
        for name, data in zip(names, blocks, strict=True):
            client.put(name, data)
        request = ScheduleRequest("q", total, tuple(source.prompt_block_keys(prompt)),
                                  source.block_size, 1)
        # The Conductor's prefill model: full and suffix-only prefill, measured once up front.
        full0 = statistics.median(first_token_s(Engine(args.model, config), prompt)
                                  for _ in range(args.reps))
        suffix0 = statistics.median(_suffix_s(args.model, config, keys, blocks, prompt)
                                    for _ in range(args.reps))
        conductor = Conductor(
            ConductorConfig.from_dict({"policy": "global_cache", "admission": "none",
                                       "fetch_only_if_faster": True}),
            ["p"], ["d"], MeasuredPrefill(full0, suffix0, prefix_len),
            DecodeStepPredictor([0.01, 0.0, 0.0]), source.pool.block_nbytes // source.block_size)
        conductor.on_blocks_stored("store", keys)
        for rate in [float(r) for r in args.rates_mbit.split(",")]:
            hosts.limit("b", rate or None)
            fetch_s, fetch_ttft, full_ttft = [], [], []
            choices: list[str] = []
            for rep in range(args.reps):
                rid = f"q{rate:g}-{rep}"
                decision = conductor.schedule(replace(request, request_id=rid), 0.0)
                conductor.on_request_aborted(rid)  # placed only to read the choice
                choices.append("fetch" if isinstance(decision, Placement)
                               and decision.fetch is not None else "recompute")
                estimate = conductor.transfer_bandwidth
                engine = Engine(args.model, config)
                start = time.perf_counter()
                got = client.get_batch(names)
                fetched = time.perf_counter() - start
                for key, got_bytes in zip(keys, got, strict=True):
                    assert got_bytes is not None, "a prefix block left the store"
                    engine.import_block_kv(key, got_bytes)
                first_token_s(engine, prompt)
                conductor.on_transfer_measured(kv_bytes, fetched)
                fetch_s.append(fetched)
                fetch_ttft.append(time.perf_counter() - start)  # fetch + import + suffix
                full_ttft.append(first_token_s(Engine(args.model, config), prompt))
            f_s, f_ttft, r_ttft = (statistics.median(v) for v in (fetch_s, fetch_ttft, full_ttft))
            bandwidth = kv_bytes / f_s
            faster = "fetch" if f_ttft < r_ttft else "recompute"
            # The row's choice: the last rep's, made on the estimate after reps - 1 fetches here.
            rows.append({"rate_mbit": rate or None, "measured_mb_per_s": bandwidth / 1e6,
                         "estimate_mb_per_s": estimate / 1e6,
                         "fetch_s": f_s, "ttft_fetch_s": f_ttft, "ttft_recompute_s": r_ttft,
                         "conductor": choices[-1], "conductor_per_rep": choices,
                         "faster": faster})
            link = f"{rate:g} Mbit/s" if rate else "unlimited"
            print(f"link {link:>14}: measured "
                  f"{bandwidth / 1e6:8.1f} MB/s, fetch {f_s * 1e3:7.1f} ms, TTFT fetch "
                  f"{f_ttft * 1e3:7.1f} ms vs recompute {r_ttft * 1e3:7.1f} ms -> faster: "
                  f"{faster:9s} Conductor (estimate {estimate / 1e6:.1f} MB/s before the last "
                  f"rep): {choices[-1]} (per rep: {', '.join(choices)})", flush=True)
        client.close()
    finally:
        hosts.close()
    summary = {"model": args.model, "prefix_tokens": prefix_len, "kv_bytes": kv_bytes,
               "prefill_model_s": {"full": full0, "suffix": suffix0},
               "rows": rows, "conductor_agrees": sum(r["conductor"] == r["faster"] for r in rows)}
    if args.json:
        print(json.dumps(summary))
    print(f"KV of the {prefix_len}-token prefix: {kv_bytes / 1e6:.2f} MB; the Conductor chose "
          f"the faster way in {summary['conductor_agrees']} of {len(rows)} bandwidths")
    return 0


def _suffix_s(model: str, config: EngineConfig, keys: list[Any], blocks: list[bytes],
              prompt: list[int]) -> float:
    """Import the prefix's KV (already in memory: no fetch) and prefill the suffix."""
    engine = Engine(model, config)
    start = time.perf_counter()
    for key, data in zip(keys, blocks, strict=True):
        engine.import_block_kv(key, data)
    imported = time.perf_counter() - start
    return imported + first_token_s(engine, prompt)


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
        return True
    except OSError:
        return False


def _nodes(hosts: NetnsHosts) -> int:
    try:
        probe = StoreClient(f"{hosts.ip('b')}:24500", transfer_config=TransferConfig(serve=False))
    except Exception:  # noqa: BLE001 (not up yet)
        return 0
    try:
        return int(probe.master.stats()["num_nodes"])
    except Exception:  # noqa: BLE001 (the master is still starting)
        return 0
    finally:
        probe.close()


if __name__ == "__main__":
    raise SystemExit(main())

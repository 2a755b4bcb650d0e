"""Conductor decision latency: p50/p99 of `Conductor.schedule` on a large, busy cluster view.

Cluster: 64 prefill + 64 decode instances (configurable), llama3-70b@a800x8 cost model with a
fitted prefill predictor (as the live cluster uses), a global index holding every prefill
instance's LRU cache (evictions reported) plus a store tier, and decode instances running ~10-16
requests each (1500-token outputs).
Prompts are 256 blocks: a shared system prompt, a session prefix that one or a few instances
(and sometimes the store) hold, and new blocks. The cluster is kept in steady state: prefills and
decodes are reported finished as simulated time advances, so queues stay bounded.

There is no external peer for this measurement; the target is the issue's p99 <= 1 ms, printed as
a ratio (p99 / target; < 1 meets it). Both wall time and process CPU time are reported: on a
shared machine wall time includes waiting for a core while other processes run, so the CPU time
per decision is the honest measure of our code (the process is single-threaded). As a reference
for what the machine alone does, a fixed allocation-free loop costing the decisions' median CPU
time is timed the same way, as many times; its wall p99 is what any code of that cost sees here.

`--gc-freeze` (the default) calls the product's `kvcake.conductor.freeze_heap()` once the cluster
view is built, as a serving process or simulator would; `--no-gc-freeze` shows the same run
without it.

    .venv/bin/python benchmarks/conductor_decision.py [--prefill 64] [--decode 64] [--blocks 256]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import os
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvcake.conductor import (
    Conductor,
    ConductorConfig,
    CostModel,
    Placement,
    PrefillTimePredictor,
    ScheduleRequest,
    freeze_heap,
    profile_grid,
)

TARGET_P99_S = 1e-3


class _Workload:
    """Seeded 256-block prompts over a populated index."""

    def __init__(self, rng: random.Random, blocks: int, num_system: int, num_sessions: int) -> None:
        self.rng, self.blocks = rng, blocks
        self.next_key = 0
        self.system = [self._fresh(blocks // 8) for _ in range(num_system)]
        self.sessions = [self.rng.choice(self.system) + self._fresh(blocks // 2)
                         for _ in range(num_sessions)]

    def _fresh(self, n: int) -> list[int]:
        keys = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        return keys

    def prompt(self) -> list[int]:
        base = self.rng.choice(self.sessions)
        keep = self.rng.randrange(len(base) // 4, len(base) + 1)
        return base[:keep] + self._fresh(self.blocks - keep)


class _LruCaches:
    """What each prefill instance holds: an LRU of keys with a capacity, as its cache would be.
    Evictions are reported to the Conductor, so the index stays at a steady size."""

    def __init__(self, conductor: Conductor, capacity_blocks: int) -> None:
        self.conductor, self.capacity = conductor, capacity_blocks
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def store(self, holder: str, keys: Sequence[int]) -> None:
        lru = self.lru.setdefault(holder, OrderedDict())
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        evicted = [lru.popitem(last=False)[0] for _ in range(len(lru) - self.capacity)]
        self.conductor.on_blocks_stored(holder, keys)
        if evicted:
            self.conductor.on_blocks_removed(holder, evicted)


def build(args: argparse.Namespace) -> tuple[Conductor, _Workload, _LruCaches]:
    cost = CostModel.from_spec(args.profile)
    predictor = PrefillTimePredictor.fit(profile_grid(cost, args.blocks * args.block_size))
    prefill_ids = [f"prefill-{i}" for i in range(args.prefill)]
    decode_ids = [f"decode-{i}" for i in range(args.decode)]
    config = ConductorConfig(policy=args.policy, ttft_slo_s=1e9, tbt_slo_s=1e9,
                             index_on_placement=args.index_on_placement)
    conductor = Conductor(config, prefill_ids, decode_ids, predictor, cost,
                          cost.model.kv_bytes_per_token)
    rng = random.Random(args.seed)
    work = _Workload(rng, args.blocks, num_system=16, num_sessions=args.sessions)
    caches = _LruCaches(conductor, args.capacity_blocks)
    for session in work.sessions:  # each session cached on 1-3 instances, half also in the store
        for holder in rng.sample(prefill_ids, rng.randint(1, 3)):
            caches.store(holder, session)
        if rng.random() < 0.5:
            conductor.on_blocks_stored("store", session)  # the store tier: unbounded here
    return conductor, work, caches


def run(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    conductor, work, caches = build(args)
    if args.gc_freeze:
        # The index's million long-lived keys need not be rescanned by every full collection.
        print(f"freeze_heap(): {freeze_heap()} objects frozen")
    if args.gc_gen0 is not None:
        # A serving process may raise the young-generation threshold, as long-running Python
        # servers do; off by default (Python's 700).
        gc.set_threshold(args.gc_gen0, 20, 20)
    block_size = args.block_size
    # Events in time order: (time, seq, kind, placement). A prefill finishes at its predicted
    # TTFT, its decode `output_len` predicted steps later; both are reported as they happen.
    events: list[tuple[float, int, str, Placement]] = []
    wall: list[float] = []
    cpu: list[float] = []
    now_s = 0.0
    for i in range(args.warmup + args.requests):
        now_s += args.interval_s
        while events and events[0][0] <= now_s:
            at_s, _, kind, done = heapq.heappop(events)
            if kind == "prefill":
                conductor.on_prefill_started(done.prefill_id, done.request_id, at_s)
                conductor.on_prefill_finished(done.prefill_id, done.request_id, at_s)
                conductor.on_transfer_done(done.request_id, at_s)
                conductor.on_decode_joined(done.decode_id, done.request_id, at_s)
            else:
                conductor.on_decode_finished(done.decode_id, done.request_id, at_s)
        keys = tuple(work.prompt())
        req = ScheduleRequest(f"r{i}", len(keys) * block_size, keys, block_size, args.output_len)
        start, start_cpu = time.perf_counter(), time.process_time()
        decision = conductor.schedule(req, now_s)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if i >= args.warmup:
            wall.append(elapsed)
            cpu.append(elapsed_cpu)
        if isinstance(decision, Placement):
            caches.store(decision.prefill_id, keys)
            prefill_end = now_s + decision.predicted_ttft_s
            decode_end = prefill_end + args.output_len * decision.predicted_tbt_s
            heapq.heappush(events, (prefill_end, 2 * i, "prefill", decision))
            heapq.heappush(events, (decode_end, 2 * i + 1, "decode", decision))
    busiest = max(len(conductor.prefill_queue(p)) for p in conductor.prefill_ids)
    batch = max(conductor.decode_load(d).batch_size for d in conductor.decode_ids)
    print(f"index: {len(conductor.index)} keys, {len(conductor.index.holders)} holders; at the "
          f"end: longest prefill queue {busiest}, largest decode batch {batch}")
    return wall, cpu


def _percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), p99, ordered[-1]


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i & 7
    return total


def machine_reference(cpu_s: float, num_samples: int) -> tuple[list[float], list[float]]:
    """Wall and CPU times of a fixed, allocation-free loop sized to cost `cpu_s` of CPU, timed
    like a decision: what this machine alone does to a constant amount of work."""
    n = 1000
    start = time.process_time()
    _spin(n)
    n = max(1, round(n * cpu_s / max(time.process_time() - start, 1e-9)))
    for _ in range(3):  # refine on the median, as timer granularity and load skew one sample
        times = []
        for _ in range(21):
            start = time.process_time()
            _spin(n)
            times.append(time.process_time() - start)
        n = max(1, round(n * cpu_s / max(statistics.median(times), 1e-9)))
    wall, cpu = [], []
    for _ in range(num_samples):
        start, start_cpu = time.perf_counter(), time.process_time()
        _spin(n)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def _report(name: str, samples: list[float]) -> None:
    p50, p99, worst = _percentiles(samples)
    print(f"{name}: p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms, max {worst * 1e3:.3f} ms; "
          f"p99/target = {p99 / TARGET_P99_S:.2f} "
          f"({'meets' if p99 <= TARGET_P99_S else 'MISSES'} p99 <= {TARGET_P99_S * 1e3:g} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--interval-s", type=float, default=0.02, help="time between arrivals")
    parser.add_argument("--output-len", type=int, default=1500)
    parser.add_argument("--index-on-placement", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--capacity-blocks", type=int, default=20000,
                        help="blocks each prefill instance caches (LRU)")
    parser.add_argument("--gc-gen0", type=int, default=None,
                        help="gc generation-0 threshold (default: Python's)")
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--policy", default="global_cache")
    parser.add_argument("--profile", default="llama3-70b@a800x8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    wall, cpu = run(args)
    print(f"load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(f"policy {args.policy}: {args.prefill} prefill + {args.decode} decode instances, "
          f"{args.blocks}-block prompts, {len(wall)} decisions, freeze_heap {args.gc_freeze}, "
          f"gc thresholds {gc.get_threshold()}")
    _report("decision latency (wall)", wall)
    _report("decision latency (process cpu)", cpu)
    ref_wall, ref_cpu = machine_reference(statistics.median(cpu), len(cpu))
    print(f"machine reference: a fixed loop of the decisions' median CPU time "
          f"({statistics.median(ref_cpu) * 1e3:.3f} ms), timed the same way")
    _report("  reference (wall)", ref_wall)
    _report("  reference (process cpu)", ref_cpu)
    ratio = _percentiles(wall)[1] / _percentiles(ref_wall)[1]
    print(f"decision wall p99 / reference wall p99 = {ratio:.2f}")

if __name__ == "__main__":
    main()

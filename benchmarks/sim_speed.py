"""Simulator speed: the whole conversation trace on 8 prefill + 8 decode instances.

Target (issue 3): <= 30 s on the development machine (2 shared CPU cores). Prints wall and CPU
seconds (the CPU is shared with other work: CPU seconds are the contention-free figure), the
ratio to the target, events per second and how much faster than real time the cluster runs.

    .venv/bin/python benchmarks/sim_speed.py [--trace PATH] [--policy global_cache] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvcake.sim.config import POLICIES, SimConfig
from kvcake.sim.run import simulate
from kvcake.sim.trace import load_trace

TARGET_S = 30.0
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/conversation_trace.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--policy", choices=POLICIES, default="global_cache")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    trace = load_trace(args.trace)
    load_wall = time.perf_counter() - wall0
    for _ in range(args.repeat):
        wall1, cpu1 = time.perf_counter(), time.process_time()
        result = simulate(SimConfig(policy=args.policy, num_prefill=8, num_decode=8), trace)
        wall, cpu = time.perf_counter() - wall1, time.process_time() - cpu1
        s = result.summary
        print(json.dumps({
            "policy": args.policy, "requests": s["requests"], "events": s["num_events"],
            "load_trace_s": round(load_wall, 2), "sim_wall_s": round(wall, 2),
            "sim_cpu_s": round(cpu, 2), "total_wall_s": round(load_wall + wall, 2),
            "target_s": TARGET_S, "wall_over_target": round((load_wall + wall) / TARGET_S, 3),
            "events_per_cpu_s": round(s["num_events"] / cpu),
            "simulated_s_per_wall_s": round(s["makespan_s"] / wall, 1),
            "mean_ttft_s": round(s["ttft_s"]["mean"], 4),
        }))
    print(f"total CPU {time.process_time() - cpu0:.1f} s")


if __name__ == "__main__":
    main()

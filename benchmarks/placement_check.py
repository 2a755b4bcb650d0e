"""Where the live Conductor and the simulated one put the same requests (issue 11 part 3).

Each live replay that `sim_vs_live.py` records keeps the live Conductor's decision for every
request (`env.placements`: `$KVCAKE_PLACEMENT_TRACE`'s lines, kvcake/server/cluster/
placement_trace.py); the replay's own requests are its last lines (the warm-up requests come
first). `agreement` sets them beside the simulated run of the same requests: a request agrees
when both put its prefill on the same instance, or both rejected it for the same reason. A
placement that differs sends a request into another queue, so it names where a latency gap
starts (the fifteenth session's colocated lead was one: docs/benchmarks.md, sixteenth session).
"""

from __future__ import annotations

from typing import Any

from kvcake.sim.config import SimConfig
from kvcake.sim.run import simulate
from kvcake.sim.trace import Trace

__all__ = ["agreement", "by_rate", "decision"]


def decision(line: dict[str, Any]) -> str:
    """A live placement line's decision: its prefill instance, or `rejected:<kind>`."""
    return str(line["prefill_id"]) if "prefill_id" in line else f"rejected:{line['rejected']}"


def agreement(live: dict[str, Any], trace: Trace, configs: dict[str, SimConfig],
              cost: Any) -> dict[str, Any]:
    """Per system with recorded placements: each replay's count of requests decided alike,
    and the requests (their index in the trace) decided otherwise in any replay."""
    out: dict[str, Any] = {}
    num = len(trace.requests)
    for system, runs in live.get("runs", {}).items():
        recorded = [run["env"]["placements"][-num:] for run in runs
                    if len(run.get("env", {}).get("placements", [])) >= num]
        if system not in configs or not recorded:
            continue
        states = simulate(configs[system], trace, cost).states
        sim = [s.prefill_instance or f"rejected:{s.rejected}" for s in states]
        differ = sorted({i for lines in recorded for i, line in enumerate(lines)
                         if decision(line) != sim[i]})
        out[system] = {"same": [sum(decision(line) == sim[i] for i, line in enumerate(lines))
                                for lines in recorded],
                       "of": num, "differ": differ}
    return out


def by_rate(setup: Any, configs: dict[str, SimConfig], cost: Any,
            files: list[tuple[float | None, dict[str, Any] | None]]) -> dict[str, Any]:
    """`agreement` at every checked rate (`check_setup.Setup`'s requests at that rate), keyed
    by the rate; rates whose replays recorded no placements are left out."""
    out: dict[str, Any] = {}
    for rate, live in files:
        if rate is not None and live is not None:
            got = agreement(live, setup.trace(setup.planned(rate)), configs, cost)
            if got:
                out[f"{rate:.4g}"] = got
    return out

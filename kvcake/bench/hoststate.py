"""The host's state between two benchmarked systems: CPU busy share, free memory, core speed.

Recorded before each system starts so that a slow second system can be told apart from a busy,
memory-short or slower machine. Linux only (/proc).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kvcake.bench.proctree import mem_available_mib

PROC = Path("/proc")


@dataclass(frozen=True)
class CpuTimes:
    """Jiffies summed over all cores: busy (not idle or iowait), steal (taken by the hypervisor
    for other guests: a busy neighbour of this VM), total."""

    busy: int
    steal: int
    total: int


def parse_cpu_line(line: str) -> CpuTimes:
    """/proc/stat's aggregate `cpu` line (idle + iowait count as idle)."""
    fields = line.split()
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        raise ValueError(f"not /proc/stat's aggregate cpu line: {line[:80]!r}")
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    steal = values[7] if len(values) > 7 else 0
    return CpuTimes(sum(values) - idle, steal, sum(values))


def cpu_times(proc: Path = PROC) -> CpuTimes:
    return parse_cpu_line((proc / "stat").read_text().splitlines()[0])


def busy_share(before: CpuTimes, after: CpuTimes) -> float | None:
    """Share of all cores' time that was busy between two `cpu_times` readings."""
    total = after.total - before.total
    return None if total <= 0 else (after.busy - before.busy) / total


def steal_share(before: CpuTimes, after: CpuTimes) -> float | None:
    """Share of all cores' time stolen by the hypervisor between two readings."""
    total = after.total - before.total
    return None if total <= 0 else (after.steal - before.steal) / total


def spin_ms(n: int = 1_000_000, rounds: int = 3) -> float:
    """Best of `rounds` timings of a fixed pure-Python loop on one core (core speed, in ms)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        total = 0
        for i in range(n):
            total += i
        best = min(best, time.perf_counter() - t0)
    return 1000.0 * best


@dataclass(frozen=True)
class HostState:
    """Before a system starts: the share of CPU busy over the settle window, MemAvailable,
    the 1-minute load average and one core's speed (`spin_ms`, lower is faster)."""

    cpu_busy: float | None
    mem_available_mib: float | None
    load1: float
    spin_ms: float

    def as_dict(self) -> dict[str, float | None]:
        return {"cpu_busy": None if self.cpu_busy is None else round(self.cpu_busy, 3),
                "mem_available_mib": self.mem_available_mib, "load1": self.load1,
                "spin_ms": round(self.spin_ms, 1)}


def settle(seconds: float) -> HostState:
    """Sleep `seconds` (nothing of ours runs), then report how busy the host was meanwhile."""
    import os
    before = cpu_times()
    time.sleep(seconds)
    busy = busy_share(before, cpu_times())
    return HostState(busy, mem_available_mib(), os.getloadavg()[0], spin_ms())

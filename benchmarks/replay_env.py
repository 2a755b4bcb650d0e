r"""What could differ between two invocations of the same live replay, recorded per replay
(issue 11 part 3, eleventh session).

Two holds of the same disaggregated replay at 0.787 req/s, 20 minutes apart on a quiet machine
(same code, same GEMM table), ran their decode 25-35% apart per token while the three replays
inside each hold agreed within 3-16% (docs/benchmarks.md, the lead's quiet reruns, tenth
session). `ReplayEnv` records, around one replay on a fresh server:

- each worker process (`kvcake worker ... --role R --parent-pid SERVER`): its torch intra-op
  threads (the cluster config's `num_threads`, what the worker hands `torch.set_num_threads`),
  its OS thread count, its CPU affinity (`sched_getaffinity`), whether `pin_workers` was on,
  where its threads actually ran (each task's `processor` field of /proc/PID/task/TID/stat,
  sampled; the CPU ticks a task gained credited to the CPU it was seen on), how often the
  decode and prefill workers' busiest threads were seen on the same CPU, and its run-queue
  wait (/proc/PID/task/TID/schedstat: ns runnable but not running, over ns run);
- the GEMM tuning tables (`kvcake/engine/linear.py`'s `linear-*.json` in the cache dir): path,
  a hash of the content before the server started and once it was healthy, and so whether the
  workers measured it at start-up (absent or changed) or loaded it (present, unchanged);
- the machine over the replay: /proc/stat deltas (per CPU: user, system, idle, steal, ... as
  shares of the interval's ticks), the load average before and after, CPU MHz where
  /proc/cpuinfo gives it;
- the decode worker's own steps (its step trace, `$KVCAKE_STEP_TRACE`): step wall and CPU
  p50 / p90 and the mean step against the mean client gap, so a replay's TBT splits into step
  time and the rest.

The parsers are pure functions of /proc text (tests/bench/test_replay_env.py feeds made-up
samples); the sampler is a thread of the benchmark process.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
SAMPLE_S = 0.05  # the placement sampler's period


def parse_proc_stat(text: str) -> dict[str, list[int]]:
    """/proc/stat's CPU lines: {"cpu": [user, nice, system, idle, iowait, irq, softirq, steal],
    "cpu0": [...], ...} (the first 8 counters, in USER_HZ ticks; missing ones are 0)."""
    out: dict[str, list[int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0].startswith("cpu"):
            ticks = [int(x) for x in parts[1:1 + len(STAT_FIELDS)]]
            out[parts[0]] = ticks + [0] * (len(STAT_FIELDS) - len(ticks))
    if "cpu" not in out:
        raise ValueError("not /proc/stat text: no 'cpu' line")
    return out


def stat_delta(before: Mapping[str, Sequence[int]],
               after: Mapping[str, Sequence[int]]) -> dict[str, dict[str, float]]:
    """Per CPU line present in both: each counter's share of the interval's ticks (sums to 1),
    and "ticks", the interval's total."""
    out: dict[str, dict[str, float]] = {}
    for name, a in after.items():
        if name not in before:
            continue
        d = [x - y for x, y in zip(a, before[name], strict=True)]
        if any(x < 0 for x in d):
            raise ValueError(f"/proc/stat {name}: a counter went backwards ({d})")
        total = sum(d)
        row = {k: (v / total if total else 0.0) for k, v in zip(STAT_FIELDS, d, strict=True)}
        row["ticks"] = float(total)
        out[name] = row
    return out


def parse_cpu_mhz(text: str) -> list[float]:
    """The "cpu MHz" of each processor in /proc/cpuinfo text ([] where it has none)."""
    return [float(line.split(":", 1)[1]) for line in text.splitlines()
            if line.startswith("cpu MHz") and ":" in line]


@dataclass(frozen=True)
class TaskStat:
    state: str
    processor: int  # the CPU it last ran on
    cpu_ticks: int  # utime + stime


def parse_task_stat(text: str) -> TaskStat:
    """/proc/PID[/task/TID]/stat: state, processor (field 39) and utime + stime (14, 15); the
    command name may hold spaces and parentheses, so fields count from the last ')'."""
    if ")" not in text:
        raise ValueError(f"not a /proc stat line: {text[:60]!r}")
    fields = text[text.rindex(")") + 2:].split()
    if len(fields) < 37:
        raise ValueError(f"/proc stat line has {len(fields) + 2} fields, needs 39")
    return TaskStat(fields[0], int(fields[36]), int(fields[11]) + int(fields[12]))


def parse_schedstat(text: str) -> tuple[int, int]:
    """/proc/PID/task/TID/schedstat: (ns on a CPU, ns runnable waiting on a run queue)."""
    parts = text.split()
    if len(parts) < 2:
        raise ValueError(f"not a schedstat line: {text!r}")
    return int(parts[0]), int(parts[1])


def table_states(directory: Path) -> dict[str, str]:
    """The GEMM tuning tables in `directory` (linear.py's `linear-*.json`): name -> sha256 of
    the content (first 16 hex digits)."""
    out = {}
    for path in sorted(directory.glob("linear-*.json")):
        try:
            out[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        except OSError:
            continue
    return out


def table_use(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str]:
    """Per table present once the server is up: "loaded" (there before, same content) or
    "measured" (absent before, or rewritten at start-up: some worker measured shapes)."""
    return {name: ("loaded" if before.get(name) == digest else "measured")
            for name, digest in after.items()}


@dataclass
class Placement:
    """Where one worker's threads ran, from `sample` calls: CPU ticks credited to the CPU each
    task was seen on, and per sample the CPU of the task that gained the most ticks."""
    ticks_by_cpu: dict[int, int] = field(default_factory=dict)
    busiest_cpu: list[int | None] = field(default_factory=list)
    last: dict[int, int] = field(default_factory=dict)  # tid -> cpu_ticks at the last sample

    def sample(self, tasks: Mapping[int, TaskStat]) -> None:
        best, best_gain = None, 0
        for tid, st in tasks.items():
            gain = st.cpu_ticks - self.last.get(tid, st.cpu_ticks)
            self.last[tid] = st.cpu_ticks
            if gain > 0:
                self.ticks_by_cpu[st.processor] = self.ticks_by_cpu.get(st.processor, 0) + gain
                if gain > best_gain:
                    best, best_gain = st.processor, gain
        self.busiest_cpu.append(best)


def same_cpu_share(a: Sequence[int | None], b: Sequence[int | None]) -> float | None:
    """Of the samples where both workers' busiest threads gained CPU, the share on one CPU
    (None: no such sample)."""
    both = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    return sum(x == y for x, y in both) / len(both) if both else None


def wait_share(before: Mapping[int, tuple[int, int]],
               after: Mapping[int, tuple[int, int]]) -> dict[str, float | None]:
    """A worker's run-queue wait over the interval from its tasks' schedstat (tid -> (run ns,
    wait ns)) before and after: run and wait seconds, and wait / (run + wait)."""
    run = sum(a[0] - before.get(t, (0, 0))[0] for t, a in after.items())
    wait = sum(a[1] - before.get(t, (0, 0))[1] for t, a in after.items())
    return {"run_s": run / 1e9, "wait_s": wait / 1e9,
            "wait_share": wait / (run + wait) if run + wait > 0 else None}


def _read(path: Path | str) -> str:
    return Path(path).read_text()


def worker_roles(session: int) -> dict[int, str]:
    """The cluster's worker processes: pid -> role (`kvcake worker ... --role R` whose session
    or `--parent-pid` is the server's session `session`)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parent = (argv[argv.index(b"--parent-pid") + 1].decode()
                  if b"--parent-pid" in argv[:-1] else "")
        if b"worker" not in argv or session not in (int(fields[3]), int(parent or -1)):
            continue
        role = argv[argv.index(b"--role") + 1].decode() if b"--role" in argv[:-1] else "worker"
        out[int(entry.name)] = role
    return out


def _tasks(pid: int) -> dict[int, TaskStat]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = parse_task_stat((task / "stat").read_text())
        except (OSError, ValueError):
            continue
    return out


def _schedstats(pid: int) -> dict[int, tuple[int, int]]:
    out = {}
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out[int(task.name)] = parse_schedstat((task / "schedstat").read_text())
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    return out


def _mhz() -> list[float]:
    try:
        return parse_cpu_mhz(_read("/proc/cpuinfo"))
    except OSError:
        return []


class ReplayEnv:
    """`start()` before the server starts (machine counters, tables), `attach(session)` once it
    is healthy (workers, affinity, sampler on), `stop()` after the replay; `report()` the
    replay's environment as plain JSON data."""

    def __init__(self, cache_dir: Path, pin_workers: bool, num_threads: Mapping[str, int | None],
                 period_s: float = SAMPLE_S) -> None:
        self.cache_dir, self.pin_workers, self.num_threads = cache_dir, pin_workers, num_threads
        self.period_s = period_s
        self._report: dict[str, Any] = {}
        self._roles: dict[int, str] = {}
        self._places: dict[int, Placement] = {}
        self._sched0: dict[int, dict[int, tuple[int, int]]] = {}
        self._stat0: dict[str, list[int]] = {}
        self._tables0: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._tables0 = table_states(self.cache_dir)
        self._report = {"pin_workers": self.pin_workers, "load_before": list(os.getloadavg()),
                        "mhz_before": _mhz(), "cache_dir": str(self.cache_dir)}

    def attach(self, session: int) -> None:
        tables = table_states(self.cache_dir)
        self._report["gemm_tables"] = {name: {"sha256_16": digest, "before": self._tables0.get(name),
                                              "use": use}
                                       for (name, digest), use in zip(
                                           tables.items(), table_use(self._tables0, tables).values(),
                                           strict=True)}
        self._roles = worker_roles(session)
        workers = {}
        for pid, role in self._roles.items():
            try:
                threads = sum(1 for _ in Path(f"/proc/{pid}/task").iterdir())
                affinity = sorted(os.sched_getaffinity(pid))
            except OSError:
                continue
            workers[f"{role}:{pid}"] = {"role": role, "pid": pid,
                                        "torch_threads": self.num_threads.get(role),
                                        "os_threads": threads, "affinity": affinity}
            self._sched0[pid] = _schedstats(pid)
            self._places[pid] = Placement()
        self._report["workers"] = workers
        self._stat0 = parse_proc_stat(_read("/proc/stat"))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for pid, place in self._places.items():
                try:
                    place.sample(_tasks(pid))
                except OSError:
                    place.busiest_cpu.append(None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._stat0:
            delta = stat_delta(self._stat0, parse_proc_stat(_read("/proc/stat")))
            self._report["proc_stat"] = {k: {f: round(v, 4) for f, v in row.items()}
                                         for k, row in delta.items()}
        by_role: dict[str, list[int | None]] = {}
        for pid, place in self._places.items():
            w = self._report["workers"][f"{self._roles[pid]}:{pid}"]
            w["ran_on_ticks"] = {str(c): n for c, n in sorted(place.ticks_by_cpu.items())}
            w["run_queue"] = wait_share(self._sched0.get(pid, {}), _schedstats(pid))
            by_role[self._roles[pid]] = place.busiest_cpu
        if "prefill" in by_role and "decode" in by_role:
            self._report["decode_prefill_same_cpu"] = same_cpu_share(by_role["decode"],
                                                                     by_role["prefill"])
        self._report |= {"load_after": list(os.getloadavg()), "mhz_after": _mhz()}

    def report(self) -> dict[str, Any]:
        return dict(self._report)


def step_split(steps: Sequence[Mapping[str, Any]], client_gaps_s: Sequence[float],
               begun: float) -> dict[str, Any]:
    """The decode worker's busy steps (step-trace records with rows, started at or after
    `begun`) against the client's gaps: step wall and CPU p50 / p90 (ms), the mean step, the
    mean client gap, and their difference (the gap time outside the decode step)."""
    import numpy as np

    busy = [s for s in steps if s["rows"] and s["t0"] >= begun]
    if not busy:
        return {"steps": 0}
    wall = [1000 * (s["t1"] - s["t0"]) for s in busy]
    cpu = [1000 * s["cpu"] for s in busy]
    out: dict[str, Any] = {
        "steps": len(busy),
        "batch_mean": float(np.mean([len(s["rows"]) for s in busy])),
        "step_wall_ms_p50": float(np.percentile(wall, 50)),
        "step_wall_ms_p90": float(np.percentile(wall, 90)),
        "step_cpu_ms_p50": float(np.percentile(cpu, 50)),
        "step_wall_ms_mean": float(np.mean(wall)),
        "wall_over_cpu": sum(wall) / max(sum(cpu), 1e-9),
    }
    if client_gaps_s:
        gap = 1000 * float(np.mean(client_gaps_s))
        out |= {"client_gap_ms_mean": gap, "gap_outside_step_ms": gap - out["step_wall_ms_mean"]}
    return out


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

"""The processes of a session (a server started with setsid) and waiting until all have exited.

A server's launcher returning, or its leader process exiting, does not mean the server is gone:
vLLM's engine-core child (and kvcake's launched workers) are separate processes in the same
session that may still be tearing down, using a core and holding gigabytes, while the next system
starts. `wait_gone` polls /proc until no process of the session is left (SIGKILL after a
deadline) and reports what it saw, so a benchmark can check the switch instead of assuming it.
Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcake.clock import Clock, SystemClock

PROC = Path("/proc")


def parse_stat(text: str) -> tuple[int, str, int, int]:
    """(pid, state, pgid, session) from a /proc/PID/stat line; comm may hold spaces or ')'."""
    head, _, tail = text.rpartition(")")
    if not tail:
        raise ValueError(f"not a /proc/PID/stat line: {text[:80]!r}")
    fields = tail.split()
    return int(head.split("(", 1)[0]), fields[0], int(fields[2]), int(fields[3])


def session_pids(sid: int, proc: Path = PROC) -> list[int]:
    """Live (not zombie) processes whose session id is `sid`."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid, state, _, session = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError):
            continue  # exited while we looked
        if session == sid and state != "Z":
            found.append(pid)
    return sorted(found)


def mem_available_mib(proc: Path = PROC) -> float | None:
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024.0
    return None


@dataclass(frozen=True)
class Teardown:
    """How a session went away: seconds until its last process exited, how many were still
    alive when the wait began, and how many had to be killed."""

    wait_s: float
    left_at_start: int
    killed: int
    still_alive: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {"wait_s": round(self.wait_s, 3), "left_at_start": self.left_at_start,
                "killed": self.killed, "still_alive": self.still_alive}


@dataclass(frozen=True)
class ProcessTable:
    """How wait_gone sees and ends processes: the host's by default, a fake one in tests."""

    list_pids: Callable[[int], list[int]] = session_pids
    kill: Callable[[int, int], None] = os.kill


def wait_gone(sid: int, timeout_s: float = 60.0, poll_s: float = 0.05,
              processes: ProcessTable = ProcessTable(),
              sleep: Callable[[float], None] | None = None,
              clock: Clock | None = None) -> Teardown:
    """Wait until no process of session `sid` is alive; SIGKILL the rest after `timeout_s`."""
    list_pids, kill = processes.list_pids, processes.kill
    clock = clock or SystemClock()
    if sleep is None:
        import time
        sleep = time.sleep
    started = clock.now_s()
    left = list_pids(sid)
    at_start, killed = len(left), 0
    while left:
        waited = clock.now_s() - started
        if killed and waited >= timeout_s + 10.0:
            break  # killed and still listed (uninterruptible sleep): give up, reported below
        if not killed and waited >= timeout_s:
            for pid in left:
                try:
                    kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
        sleep(poll_s)
        left = list_pids(sid)
    return Teardown(clock.now_s() - started, at_start, killed, len(left))

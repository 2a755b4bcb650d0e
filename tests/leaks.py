"""What a test module leaves running: threads, processes and listening ports (tests/conftest.py
checks it after each module's last teardown).

A thread or process a test forgot to stop outlives it, and one that dials an address may reach
whatever later binds that port (another test's worker, whose link it takes over). Every thread
is tagged with the test that started it, and every process of the run (children, grandchildren
and orphans alike) carries `SESSION_ENV` in its environment, so a leftover names its origin.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field

SESSION_ENV = "KVCAKE_TEST_SESSION"
# Threads of libraries that live for the process (tqdm's monitor) or end on their own after an
# idle spell (AnyIO's worker pool): not the tests' to stop.
LIBRARY_THREADS = ("tqdm_monitor", "AnyIO worker thread")
# Helpers a library starts once per process (multiprocessing's shared-memory tracker).
LIBRARY_PROCESSES = ("multiprocessing.resource_tracker",)
_LISTEN = "0A"

current_test = "(collection)"  # the nodeid being run, for the origin tag


def install() -> str:
    """Mark this run's processes and tag threads with their test; returns the session mark."""
    mark = os.environ.setdefault(SESSION_ENV, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    start = threading.Thread.start
    if getattr(start, "_kvcake_tagged", False):
        return mark

    def tagged_start(self: threading.Thread) -> None:
        self._kvcake_origin = current_test  # type: ignore[attr-defined]
        start(self)

    tagged_start._kvcake_tagged = True  # type: ignore[attr-defined]
    threading.Thread.start = tagged_start  # type: ignore[method-assign]
    return mark


@dataclass(frozen=True)
class Running:
    """Threads (by ident), processes (pid -> cmdline) and listening TCP ports of the moment."""

    threads: dict[int, str] = field(default_factory=dict)
    processes: dict[int, str] = field(default_factory=dict)
    ports: frozenset[int] = frozenset()

    def minus(self, other: Running) -> Running:
        return Running({k: v for k, v in self.threads.items() if k not in other.threads},
                       {k: v for k, v in self.processes.items() if k not in other.processes},
                       self.ports - other.ports)

    def union(self, other: Running) -> Running:
        return Running({**self.threads, **other.threads}, {**self.processes, **other.processes},
                       self.ports | other.ports)

    def __bool__(self) -> bool:
        return bool(self.threads or self.processes or self.ports)

    def describe(self) -> str:
        lines = [f"thread {name}" for name in sorted(self.threads.values())]
        lines += [f"process {pid}: {cmd}" for pid, cmd in sorted(self.processes.items())]
        lines += [f"listening port {port}" for port in sorted(self.ports)]
        return "\n  ".join(lines)


def running(mark: str) -> Running:
    threads = {t.ident: f"{t.name!r} (started by {getattr(t, '_kvcake_origin', '?')})"
               for t in threading.enumerate()
               if t is not threading.main_thread() and t.ident is not None and t.is_alive()
               and not t.name.startswith(LIBRARY_THREADS)}
    return Running(threads, _processes(mark), _listening_ports())


def _processes(mark: str) -> dict[int, str]:
    """Live processes carrying the session mark (ours, even once orphaned), but this one."""
    needle = f"{SESSION_ENV}={mark}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not reaped yet
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if not any(helper in cmd for helper in LIBRARY_PROCESSES):
            found[int(entry)] = cmd
    return found


def _listening_ports() -> frozenset[int]:
    """TCP ports this process listens on (its sockets in /proc/net/tcp{,6} in LISTEN)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return frozenset(ports)


def left_over(mark: str, before: Running, allowed: Running, wait_s: float) -> Running:
    """What runs now that did not before and is not `allowed`, after giving it up to `wait_s`
    to end (threads joined with a timeout by close() may still be on their way out)."""
    deadline = time.monotonic() + wait_s
    while True:
        extra = running(mark).minus(before).minus(allowed)
        if not extra or time.monotonic() >= deadline:
            return extra
        time.sleep(0.05)

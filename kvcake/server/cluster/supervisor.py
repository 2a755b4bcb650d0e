"""Keeps a cluster's worker processes running: reap, clean up, restart, rejoin.

One thread (`start()`) calls `tick(now_s)` every `poll_s`; tests call `tick` themselves. Each
tick, for every launched worker:
- its process exited (it is reaped by `poll()`): the shared-memory blocks it created are
  unlinked (`unlink_blocks_of(pid)`: a decode worker's KV pool, its store node's DRAM
  segment), the backend is told it is dead (`DisaggBackend.worker_dead`: lost if it was not,
  and the decode blocks kept out of use for its prefills are freed), and its restart is booked
  after the `RestartBook`'s backoff, or, past the crash-loop limit, given up with a clear error
  (`failures`, logged);
- its restart is due: a new process under the same worker id (`launch`), awaited (`await_ready`)
  and handed to the backend (`add_worker`: back in the Conductor; its store node registers
  again with the master itself). A start that fails counts as a death;
- the backend declared it lost (hung: pings unanswered for `worker_timeout_s`, e.g. SIGSTOP)
  while its process lives: after `hung_grace_s` it is killed (SIGKILL works on a stopped
  process), then reaped and replaced as above. One that comes back before it is declared lost
  (SIGCONT) simply goes on.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvcake.clock import Clock, SystemClock
from kvcake.server.cluster.restart_policy import CrashLoop, RestartBook, RestartPolicy
from kvcake.transfer.segment import unlink_blocks_of

log = logging.getLogger(__name__)

__all__ = ["Relaunch", "Supervisor"]


class SupervisedBackend(Protocol):
    def live_worker_ids(self) -> list[str]: ...

    def worker_dead(self, worker_id: str, why: str = ...) -> int: ...

    def add_worker(self, address: str) -> object: ...


@dataclass(frozen=True)
class Relaunch:
    """How a worker is started again: `launch(worker_id)` starts a new process for that worker;
    `await_ready(worker_id, process)` returns its control address once it serves
    (RuntimeError if it does not)."""

    launch: Callable[[str], subprocess.Popen[str]]
    await_ready: Callable[[str, subprocess.Popen[str]], str]


class Supervisor:
    def __init__(self, processes: dict[str, subprocess.Popen[str]], backend: SupervisedBackend,
                 relaunch: Relaunch, policy: RestartPolicy | None = None,
                 clock: Clock | None = None, poll_s: float = 0.2) -> None:
        """`processes`: worker id -> its process, shared with the launcher (replaced here on a
        restart); `relaunch`: how a worker's new process is started and awaited."""
        self.processes = processes
        self.backend = backend
        self._launch, self._await_ready = relaunch.launch, relaunch.await_ready
        self.policy = policy or RestartPolicy()
        self.book = RestartBook(self.policy)
        self.clock = clock or SystemClock()
        self.poll_s = poll_s
        self.lock = threading.RLock()  # held for a whole tick; the launcher's kills take it
        self.restarts: dict[str, int] = {}  # worker id -> restarts done
        self.reaped: list[tuple[str, int, int | None, list[str]]] = []  # (id, pid, code, shm)
        self._due: dict[str, float] = {}  # worker id -> when to start it again
        self._lost_since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def failures(self) -> dict[str, str]:
        """Workers given up on (crash loop), with the error that says why."""
        return self.book.given_up

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="kvcake-supervisor", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick(self.clock.now_s())
            except Exception:  # the supervisor must outlive any one bad round
                log.exception("supervisor: a round failed")

    def tick(self, now_s: float) -> None:
        live = set(self.backend.live_worker_ids())
        with self.lock:
            for worker_id, proc in list(self.processes.items()):
                if self._stop.is_set():
                    return
                if worker_id in self.failures:
                    continue
                due = self._due.get(worker_id)
                if due is not None:
                    if now_s >= due:
                        del self._due[worker_id]
                        self._restart(worker_id, now_s)
                    continue
                if proc.poll() is not None:
                    self._reap(worker_id, proc, now_s)
                elif worker_id not in live:
                    since = self._lost_since.setdefault(worker_id, now_s)
                    if now_s - since >= self.policy.hung_grace_s:
                        log.warning("worker %s (pid %d) was declared lost but its process "
                                    "lives (hung?): killing it to replace it", worker_id,
                                    proc.pid)
                        proc.kill()
                        self._lost_since.pop(worker_id, None)
                else:
                    self._lost_since.pop(worker_id, None)

    def _reap(self, worker_id: str, proc: subprocess.Popen[str], now_s: float) -> None:
        code = proc.returncode
        removed = unlink_blocks_of(proc.pid)
        if proc.stdout is not None:
            proc.stdout.close()
        self.reaped.append((worker_id, proc.pid, code, removed))
        why = f"its process {proc.pid} exited with code {code}"
        self.backend.worker_dead(worker_id, why)
        try:
            delay_s = self.book.on_death(worker_id, now_s, f"exited with code {code}")
        except CrashLoop as exc:
            log.error("%s", exc)
            return
        self._due[worker_id] = now_s + delay_s
        log.warning("worker %s: %s (%d shared-memory blocks unlinked); restarting it in "
                    "%.1f s", worker_id, why, len(removed), delay_s)

    def _restart(self, worker_id: str, now_s: float) -> None:
        proc = self._launch(worker_id)
        self.processes[worker_id] = proc
        try:
            address = self._await_ready(worker_id, proc)
            self.backend.add_worker(address)
        except (RuntimeError, ValueError, OSError) as exc:
            log.warning("worker %s: restart failed (%s)", worker_id, exc)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self._reap(worker_id, proc, now_s)
            return
        self.restarts[worker_id] = self.restarts.get(worker_id, 0) + 1
        log.warning("worker %s restarted (pid %d) and rejoined at %s", worker_id, proc.pid,
                    address)

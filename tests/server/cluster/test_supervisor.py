"""Supervision of worker processes, driven tick by tick with a manual clock and fake processes:
reap -> shared memory unlinked, backend told, restart after the backoff -> rejoin; a hung
worker killed and replaced; a crash loop turned into a clear error."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from kvcake.clock import ManualClock
from kvcake.server.cluster.restart_policy import CrashLoop, RestartBook, RestartPolicy
from kvcake.server.cluster.supervisor import Relaunch, Supervisor
from kvcake.transfer.segment import SHM_DIR, block_prefix


class FakeProc:
    next_pid = 4_000_000  # above any real pid (pid_max is at most 2^22)

    def __init__(self) -> None:
        FakeProc.next_pid += 1
        self.pid = FakeProc.next_pid
        self.returncode: int | None = None
        self.stdout = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)
        self.returncode = -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class FakeBackend:
    def __init__(self, live: set[str]) -> None:
        self.live = live
        self.calls: list[tuple[str, str]] = []

    def live_worker_ids(self) -> list[str]:
        return sorted(self.live)

    def worker_dead(self, worker_id: str, why: str = "") -> int:
        self.live.discard(worker_id)
        self.calls.append(("dead", worker_id))
        return 0

    def add_worker(self, address: str) -> Any:
        worker_id = address.split("@")[0]
        self.live.add(worker_id)
        self.calls.append(("add", worker_id))


class Rig:
    def __init__(self, policy: RestartPolicy, fail_starts: int = 0) -> None:
        self.clock = ManualClock()
        self.procs: dict[str, Any] = {"prefill-0": FakeProc(), "decode-1": FakeProc()}
        self.backend = FakeBackend(set(self.procs))
        self.launched: list[str] = []
        self.fail_starts = fail_starts
        self.supervisor = Supervisor(self.procs, self.backend, Relaunch(self.launch, self.ready),
                                     policy, self.clock)

    def launch(self, worker_id: str) -> Any:
        self.launched.append(worker_id)
        return FakeProc()

    def ready(self, worker_id: str, proc: Any) -> str:
        if self.fail_starts:
            self.fail_starts -= 1
            proc.returncode = 1
            raise RuntimeError(f"worker {worker_id} did not start")
        return f"{worker_id}@127.0.0.1:1"

    def tick(self, advance_s: float = 0.0) -> None:
        self.clock.advance(advance_s)
        self.supervisor.tick(self.clock.now_s())


POLICY = RestartPolicy(backoff_s=1.0, max_backoff_s=4.0, max_restarts=3, window_s=60.0)


def test_a_dead_worker_is_reaped_cleaned_and_restarted_after_the_backoff() -> None:
    rig = Rig(POLICY)
    dead = rig.procs["decode-1"]
    block = os.path.join(SHM_DIR, f"{block_prefix(dead.pid)}cafe")
    other = os.path.join(SHM_DIR, f"{block_prefix(dead.pid + 1)}cafe")
    for path in (block, other):
        with open(path, "wb") as f:
            f.write(b"kv")
    try:
        dead.returncode = -signal.SIGKILL
        rig.tick()
        assert rig.backend.calls == [("dead", "decode-1")]
        assert not os.path.exists(block)  # the dead process's block, unlinked by its reaper
        assert os.path.exists(other)  # another process's block is left alone
        assert rig.supervisor.reaped[0][:3] == ("decode-1", dead.pid, -signal.SIGKILL)
        rig.tick(0.9)
        assert rig.launched == []  # the backoff is not over
        rig.tick(0.1)
        assert rig.launched == ["decode-1"]
        assert rig.backend.calls[-1] == ("add", "decode-1")
        assert rig.procs["decode-1"] is not dead
        assert rig.supervisor.restarts == {"decode-1": 1}
        rig.tick(1.0)
        assert rig.launched == ["decode-1"]  # alive and live: left alone
    finally:
        for path in (block, other):
            if os.path.exists(path):
                os.unlink(path)


def test_a_hung_worker_declared_lost_is_killed_then_replaced() -> None:
    rig = Rig(RestartPolicy(backoff_s=1.0, hung_grace_s=2.0))
    hung = rig.procs["prefill-0"]
    rig.backend.live.discard("prefill-0")  # the backend's pings went unanswered (SIGSTOP)
    rig.tick()
    rig.tick(1.9)
    assert hung.signals == []  # within the grace: it may come back
    rig.tick(0.1)
    assert hung.signals == [signal.SIGKILL]
    rig.tick()  # reaped
    assert ("dead", "prefill-0") in rig.backend.calls
    rig.tick(1.0)
    assert rig.launched == ["prefill-0"] and "prefill-0" in rig.backend.live


def test_a_worker_that_comes_back_is_left_alone() -> None:
    rig = Rig(RestartPolicy(backoff_s=1.0, hung_grace_s=5.0))
    rig.backend.live.discard("prefill-0")
    rig.tick()
    rig.backend.live.add("prefill-0")  # answered again (SIGCONT) before the grace ran out
    rig.tick(10.0)
    assert rig.procs["prefill-0"].signals == [] and rig.launched == []


def test_a_crash_loop_becomes_a_clear_error_and_no_more_restarts() -> None:
    rig = Rig(POLICY, fail_starts=10)  # every restart dies at start
    rig.procs["decode-1"].returncode = 1
    for _ in range(20):
        rig.tick(5.0)
    assert rig.launched == ["decode-1"] * 3  # max_restarts
    message = rig.supervisor.failures["decode-1"]
    assert "died 4 times in 60 s (limit 3): not restarting it (a crash loop)" in message
    assert "prefill-0" not in rig.supervisor.failures


def test_backoff_doubles_up_to_its_cap_and_resets_after_the_window() -> None:
    book = RestartBook(POLICY)
    assert [book.on_death("w", t) for t in (0.0, 1.0, 2.0)] == [1.0, 2.0, 4.0]
    with pytest.raises(CrashLoop, match="died 4 times in 60 s"):
        book.on_death("w", 3.0)
    with pytest.raises(CrashLoop):  # given up for good
        book.on_death("w", 500.0)
    other = RestartBook(POLICY)
    assert [other.on_death("v", t) for t in (0.0, 1.0)] == [1.0, 2.0]
    assert other.on_death("v", 100.0) == 1.0  # the earlier deaths left the window
    assert RestartBook(RestartPolicy(max_backoff_s=3.0, backoff_s=2.0)).on_death("u", 0) == 2.0


def test_restarts_off_give_up_at_the_first_death() -> None:
    with pytest.raises(CrashLoop, match="restarts are off"):
        RestartBook(RestartPolicy(enabled=False)).on_death("w", 0.0)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("backoff_s", 0.0, "restart.backoff_s: must be > 0"),
    ("max_backoff_s", 0.1, "restart.max_backoff_s: must be >= backoff_s"),
    ("max_restarts", -1, "restart.max_restarts: must be >= 0"),
    ("hung_grace_s", -1.0, "restart.hung_grace_s: must be >= 0"),
])
def test_bad_policies_name_the_field(field: str, value: float, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        RestartPolicy(**{field: value})

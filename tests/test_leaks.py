"""The leak guard's view (tests/leaks.py): what it sees running, and what it lets go."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from tests import leaks

MARK = os.environ[leaks.SESSION_ENV]


def test_a_thread_a_process_and_a_listener_left_running_are_named() -> None:
    before = leaks.running(MARK)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-behind", daemon=True)
    thread.start()
    # The child says it runs before it is looked for: between exec and the new image's set-up,
    # /proc/PID/environ reads empty, so a child caught in that window would not carry the mark.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stdout.readline() == b"up\n"
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        extra = leaks.left_over(MARK, before, leaks.Running(), wait_s=0.0)
        assert list(extra.threads.values()) == [
            "'left-behind' (started by tests/test_leaks.py::"
            "test_a_thread_a_process_and_a_listener_left_running_are_named)"]
        assert list(extra.processes) == [child.pid]
        assert extra.ports == {listener.getsockname()[1]}
        assert "thread 'left-behind'" in extra.describe()
        assert not leaks.left_over(MARK, before, extra, wait_s=0.0)  # allowed: nothing left
    finally:
        stop.set()
        thread.join()
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
        listener.close()
    assert not leaks.left_over(MARK, before, leaks.Running(), wait_s=5.0)  # all stopped

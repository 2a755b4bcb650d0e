"""`serve_disaggregated` as a user runs it: a foreground process with worker children that
answers HTTP and, on SIGTERM, stops every child (no orphans)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SCRIPT = """
import sys
from kvcake.conductor import ConductorConfig
from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import serve_disaggregated
config = ClusterConfig.simple(1, 1, port=0, engine=EngineConfig(kv_cache_bytes=8 << 20),
                              conductor=ConductorConfig(admission="none"),
                              profile_dir=sys.argv[1])
sys.exit(serve_disaggregated(config))
"""


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_serve_answers_and_sigterm_stops_every_child(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    profiles = tmp_path_factory.getbasetemp() / "kvcake-profiles"  # shared by the session
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(profiles)],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the server exited before serving"
            match = re.search(r"kvcake serve: (http://\S+)", line)
            url = match.group(1) if match else None
        assert url is not None
        workers = children_of(proc.pid)
        assert len(workers) == 2
        reply = httpx.post(url + "/v1/completions",
                           json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True},
                           timeout=60)
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

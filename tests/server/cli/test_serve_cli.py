"""`kvcake serve` as a user runs it: a subprocess on 127.0.0.1 with an OS-chosen port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from kvcake.cli import main
from kvcake.engine import cpu_ops


@pytest.mark.parametrize("mode", ["single", "disaggregated", "colocated"])
def test_serve_subprocess_answers_and_stops(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`kvcake serve` as the README runs it, in each mode: answers, then stops on SIGTERM."""
    # A cache of its own (profiles, tuned linear tables), but the CPU ops the suite already
    # built (`make setup` builds them): a fresh build took 80-145 s of a loaded core, most of
    # the start-up deadline below, and failed this test when a compile took longer.
    cpu_ops.load()  # built here, if not yet, before the deadline starts
    env = dict(os.environ, KVCAKE_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "kvcake-cache"),
               KVCAKE_EXT_DIR=str(cpu_ops.ext_dir()))
    proc = subprocess.Popen([sys.executable, "-m", "kvcake", "serve", "--port", "0",
                             "--mode", mode, "--kv-cache-bytes", "16MiB"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        match = None
        deadline = time.monotonic() + 180
        while match is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "kvcake serve exited before serving"
            match = re.search(r"kvcake serve: (http://127\.0\.0\.1:\d+)", line)
        assert match is not None
        url = match.group(1)
        reply = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200
        assert reply.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                         "total_tokens": 5,
                                         "prompt_tokens_details": {"cached_tokens": 0}}
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises SIGTERM (the conventional status).
        assert proc.wait(timeout=60) in (0, -15)


def test_unknown_mode_and_bad_worker_counts_are_clear_errors(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["serve", "--mode", "turbo"]) == 2
    assert "unknown mode 'turbo'" in capsys.readouterr().err
    assert main(["serve", "--prefill", "0"]) == 2
    assert "--prefill / --decode: need at least 1 of each" in capsys.readouterr().err


def test_help_renders(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    assert "--max-waiting-requests" in capsys.readouterr().out


def test_bad_size_is_a_clear_error(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["serve", "--kv-cache-bytes", "lots"]) == 2
    assert "--kv-cache-bytes" in capsys.readouterr().err

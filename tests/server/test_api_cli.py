"""`kvcake serve` as a user runs it: a subprocess on 127.0.0.1 with an OS-chosen port."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from kvcake.cli import main


def test_serve_subprocess_answers_and_stops() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvcake", "serve", "--port", "0",
                             "--kv-cache-bytes", "16MiB"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        url = match.group(0)
        reply = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200
        assert reply.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                         "total_tokens": 5,
                                         "prompt_tokens_details": {"cached_tokens": 0}}
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises SIGTERM (the conventional status).
        assert proc.wait(timeout=30) in (0, -15)


def test_unknown_and_unimplemented_modes_are_clear_errors(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["serve", "--mode", "turbo"]) == 2
    assert "unknown mode 'turbo'" in capsys.readouterr().err
    assert main(["serve", "--mode", "disaggregated"]) == 2
    assert "not implemented yet; use --mode colocated" in capsys.readouterr().err


def test_help_renders(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    assert "--max-waiting-requests" in capsys.readouterr().out


def test_bad_size_is_a_clear_error(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["serve", "--kv-cache-bytes", "lots"]) == 2
    assert "--kv-cache-bytes" in capsys.readouterr().err

"""`$KVCAKE_STEP_TRACE` in `--mode single`: the engine loop writes one line per engine step (the
step's start and end, the end of handing its tokens to the request loops, the engine thread's
CPU seconds in it, the sequences it ran), as the decode worker does; nothing without it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvcake.engine.step_trace import ENV
from kvcake.server.frontend.backend import GenerateRequest
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig
from kvcake.types import RequestId


def _serve_one(max_tokens: int) -> int:
    async def scenario(backend: LocalBackend) -> int:
        stream = await backend.generate(GenerateRequest(RequestId("r"), (5, 6, 7), max_tokens,
                                                        temperature=0.0, ignore_eos=True))
        return len([t async for event in stream for t in event.token_ids])

    with LocalBackend.from_config(LocalBackendConfig(num_threads=1)) as backend:
        return asyncio.run(scenario(backend))


def test_one_line_per_engine_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    assert _serve_one(max_tokens=4) == 4
    [path] = tmp_path.glob("steps-single-*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4  # the prompt's step (first token), then one per later token
    assert lines[0]["rows"] == []  # the request was still waiting when the first step began
    assert [line["rows"] for line in lines[1:]] == [[["r", n]] for n in (4, 5, 6)]
    for line in lines:
        assert line["t0"] <= line["t1"] <= line["t2"] and line["cpu"] >= 0


def test_no_trace_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert _serve_one(max_tokens=2) == 2
    assert list(tmp_path.iterdir()) == []

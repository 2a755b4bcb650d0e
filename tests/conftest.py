"""Shared fixtures. Tests are CPU-only and deterministic; they never download anything."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
TRACES = SHARED / "traces"


@pytest.fixture
def shared_traces() -> Path:
    """../shared/traces, or a skip that says why."""
    if not (TRACES / "conversation_trace.jsonl").is_file():
        pytest.skip(f"the published Mooncake traces are not at {TRACES} (../shared is absent)")
    return TRACES

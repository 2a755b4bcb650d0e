"""The soak's transport-fault switch: a JSON file turns drops/delays on, its absence off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcake.clock import ManualClock
from kvcake.server.worker.faults import ENV_VAR, NO_FAULTS, FaultSwitch, wrapper_from_env
from kvcake.transfer.faulty import FaultSpec


def test_the_file_switches_faults_on_and_off(tmp_path: Path) -> None:
    path, clock = tmp_path / "faults.json", ManualClock()
    switch = FaultSwitch(str(path), poll_s=0.5, clock=clock)
    assert switch.spec() == NO_FAULTS
    path.write_text(json.dumps({"drop_rate": 0.25, "delay_rate": 0.5, "delay_s": 0.01}))
    assert switch.spec() == NO_FAULTS  # not re-read before poll_s
    clock.advance(0.5)
    assert switch.spec() == FaultSpec(drop_rate=0.25, delay_rate=0.5, delay_s=0.01)
    path.write_text("{half")
    clock.advance(0.5)
    assert switch.spec() == NO_FAULTS  # unreadable: no faults
    path.unlink()
    clock.advance(0.5)
    assert switch.spec() == NO_FAULTS


def test_only_the_environment_variable_turns_the_wrapper_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert wrapper_from_env() is None
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "f.json"))
    assert wrapper_from_env() is not None

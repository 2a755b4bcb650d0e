"""benchmarks/store_vs_peers.py checks its peers before any server starts: each one missing is
named with what to do, and a run that lacks one exits 2 having started nothing; its rounds
rotate the order the systems are measured in."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import store_peers  # noqa: E402
import store_vs_peers as svp  # noqa: E402


def test_each_missing_peer_is_named_with_what_to_do(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(store_peers, "MOONCAKE_VENV", tmp_path / "no-venv")
    missing = svp.missing_peers(set())
    assert len(missing) == 3
    assert "apt-get install redis-server" in missing[0]
    assert "pip install 'redis>=5'" in missing[1]
    assert "mooncake_store_setup.sh" in missing[2] and str(tmp_path / "no-venv") in missing[2]
    assert svp.missing_peers({"redis", "mooncake"}) == []


def test_a_run_without_its_peers_starts_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(store_peers, "MOONCAKE_VENV", tmp_path / "no-venv")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a server was started")

    monkeypatch.setattr(svp.Ours, "start", never)
    assert svp.main(["--skip", "redis,transfer"]) == 2
    assert "missing peers" in capsys.readouterr().err


def test_each_round_starts_one_system_later() -> None:
    systems = ["ours", "redis", "mooncake"]
    assert [svp.turn_order(systems, r) for r in range(4)] == [
        ["ours", "redis", "mooncake"],
        ["redis", "mooncake", "ours"],
        ["mooncake", "ours", "redis"],
        ["ours", "redis", "mooncake"],
    ]
    assert svp.turn_order([], 2) == []

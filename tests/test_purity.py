"""The pure core imports neither torch, sockets, threads nor a clock (DESIGN.md section 3)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "kvcake"
PURE = [
    "types.py",
    "hashing.py",
    "conductor",
    "engine/block_manager.py",
    "engine/batcher.py",
    "store/index.py",
    "store/space.py",
    "store/tiering.py",
    "store/slots.py",
    "store/leases.py",
    "store/eviction.py",
    "store/objects.py",
    "store/placement.py",
    "store/allocator.py",
]
BANNED = {"torch", "socket", "threading", "asyncio", "time", "datetime", "multiprocessing", "zmq",
          "subprocess"}


def _pure_files() -> list[Path]:
    files: list[Path] = []
    for entry in PURE:
        path = PKG / entry
        if path.is_dir():
            files.extend(sorted(path.rglob("*.py")))
        elif path.is_file():
            files.append(path)
    return files


@pytest.mark.parametrize("path", _pure_files(), ids=lambda p: str(p.relative_to(PKG)))
def test_pure_module_imports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module.split(".")[0]]
        banned = set(names) & BANNED
        assert not banned, f"{path.relative_to(PKG)}:{node.lineno} imports {banned}"


def test_pure_core_exists() -> None:
    assert len(_pure_files()) >= 2

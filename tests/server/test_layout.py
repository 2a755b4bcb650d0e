"""The server's layout: every module imports, and imports go one way.

The graph is read from the source (every `import`, including those inside functions and under
`TYPE_CHECKING`: a lazy import still ties two modules together), restricted to `kvcake.server`.
No module may reach itself, and the sub-packages depend on each other only as
`kvcake/server/__init__.py` says: `cli` -> `cluster` -> `frontend`, `worker`.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "kvcake" / "server"

# sub-package -> the sub-packages it may import (besides itself)
ALLOWED = {
    "frontend": set(),
    "worker": set(),
    "cluster": {"frontend", "worker"},
    "cli": {"frontend", "cluster", "worker"},
}


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path, base: Path = ROOT) -> dict[str, Path]:
    """Module name -> file of every module under `root` (`base` holds the top package)."""
    return {_module_name(p, base): p for p in sorted(root.rglob("*.py"))}


def _imports(path: Path, known: Mapping[str, Path]) -> set[str]:
    """The modules of `known` that `path` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}: relative import at line {node.lineno}; use the full "
                                 "kvcake.server... path")
    return {name for name in found if name in known}


def import_graph(root: Path = SERVER, base: Path = ROOT) -> dict[str, set[str]]:
    known = _modules(root, base)
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it has none (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in ALLOWED) else None


def test_every_server_module_imports() -> None:
    modules = _modules(SERVER)
    assert len(modules) > 25
    for name in modules:
        importlib.import_module(name)


def test_no_module_of_the_server_reaches_itself() -> None:
    assert find_cycle(import_graph()) is None


def test_subpackages_import_one_way() -> None:
    wrong = []
    for module, targets in import_graph().items():
        source = _subpackage(module)
        for target in targets:
            dest = _subpackage(target)
            if source is not None and dest is not None and dest != source \
                    and dest not in ALLOWED[source]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, f"imports against the layout: {wrong}"


def test_every_module_lies_in_a_subpackage() -> None:
    loose = [m for m in _modules(SERVER) if m != "kvcake.server" and _subpackage(m) is None]
    assert not loose, f"modules outside frontend/cluster/worker/cli: {loose}"
    assert {m.split(".")[2] for m in _modules(SERVER) if m != "kvcake.server"} == set(ALLOWED)


def test_the_rest_of_kvcake_does_not_import_the_server() -> None:
    server = _modules(SERVER)
    outside = [p for p in (ROOT / "kvcake").rglob("*.py") if SERVER not in p.parents]
    wrong = [f"{p.relative_to(ROOT)} -> {sorted(_imports(p, server))}" for p in outside
             if _imports(p, server)]
    assert not wrong, wrong


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d2"}, "d2": {"d"}}, ["d", "d2", "d"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_find_cycle_finds_one_when_there_is_one(graph: dict[str, set[str]],
                                               cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


def test_the_graph_sees_lazy_and_from_package_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "kvcake" / "server" / "worker"
    pkg.mkdir(parents=True)
    for init in (pkg.parent / "__init__.py", pkg / "__init__.py"):
        init.write_text("")
    (pkg / "a.py").write_text("def f():\n    from kvcake.server.worker import b\n")
    (pkg / "b.py").write_text("from kvcake.server.worker.a import f\n")
    graph = import_graph(tmp_path / "kvcake" / "server", tmp_path)
    assert graph["kvcake.server.worker.a"] == {"kvcake.server.worker", "kvcake.server.worker.b"}
    assert find_cycle(graph) == ["kvcake.server.worker.a", "kvcake.server.worker.b",
                                 "kvcake.server.worker.a"]

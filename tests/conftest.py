"""Shared fixtures. Tests are CPU-only and deterministic; they never download anything."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import leaks

SHARED = Path(__file__).resolve().parents[2] / "shared"
TRACES = SHARED / "traces"


@pytest.fixture
def shared_traces() -> Path:
    """../shared/traces, or a skip that says why."""
    if not (TRACES / "conversation_trace.jsonl").is_file():
        pytest.skip(f"the published Mooncake traces are not at {TRACES} (../shared is absent)")
    return TRACES


# -- leak guard (tests/leaks.py) ------------------------------------------------------------
# After the last teardown of each test module, whatever that module started and did not stop
# (a thread, a process, a listening port) is an error of that teardown, naming the test that
# started it. Session-scoped fixtures (etcd) are allowed to live on. KVCAKE_LEAK_GUARD=off
# turns the check off (e.g. while debugging one test with a breakpoint).
LEAK_WAIT_S = 10.0  # only spent when something is left: threads on their way out end in it
_GUARD = os.environ.get("KVCAKE_LEAK_GUARD", "on") != "off"
_MARK = leaks.install()
_session_owned = leaks.Running()
_module_start: dict[str, leaks.Running] = {}


class _SessionFixtures:
    """What session-scoped fixtures start is theirs to keep. A plugin, not a hook of this file:
    a session fixture is set up through the session's hooks, which see only a root conftest."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any],
                             request: pytest.FixtureRequest) -> Iterator[Any]:
        if fixturedef.scope != "session":
            return (yield)
        global _session_owned
        before = leaks.running(_MARK)
        try:
            return (yield)
        finally:
            _session_owned = _session_owned.union(leaks.running(_MARK).minus(before))


def pytest_configure(config: pytest.Config) -> None:
    if _GUARD and not config.pluginmanager.has_plugin("kvcake-session-fixtures"):
        config.pluginmanager.register(_SessionFixtures(), "kvcake-session-fixtures")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    leaks.current_test = item.nodeid
    if _GUARD and item.module.__name__ not in _module_start:  # type: ignore[attr-defined]
        _module_start[item.module.__name__] = leaks.running(_MARK)  # type: ignore[attr-defined]
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield  # the module's fixtures are torn down in here when it was its last test
    module = item.module.__name__  # type: ignore[attr-defined]
    last = nextitem is None or nextitem.module is not item.module  # type: ignore[attr-defined]
    if _GUARD and last:
        extra = leaks.left_over(_MARK, _module_start[module], _session_owned, LEAK_WAIT_S)
        if extra:
            pytest.fail(f"{module} left running after its last test:\n  {extra.describe()}\n"
                        "stop it in the test or fixture that started it (close() / a "
                        "finalizer)", pytrace=False)
    return result

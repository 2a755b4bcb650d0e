"""Runs the suite in another order, to find tests that pass only after (or before) another one.

    KVCAKE_TEST_ORDER=reverse        python -m pytest -p tests.order
    KVCAKE_TEST_ORDER=shuffle:SEED   python -m pytest -p tests.order

`reverse` runs every test in the opposite order; `shuffle:SEED` shuffles the modules, and the
tests inside each module, from SEED (the same seed, the same order). A module's tests stay
together either way: module-scoped fixtures and the leak guard (tests/conftest.py) work per
module. Unset, the order is pytest's own. A plugin, loaded only when named: no run depends on it.
"""

from __future__ import annotations

import os
import random

import pytest

ENV = "KVCAKE_TEST_ORDER"


def reorder(items: list[pytest.Item], order: str) -> list[pytest.Item]:
    """`items` in `order` ("", "reverse" or "shuffle:SEED"); ValueError names what to change."""
    if not order:
        return list(items)
    if order == "reverse":
        return items[::-1]
    kind, _, seed = order.partition(":")
    if kind != "shuffle" or not seed.lstrip("-").isdigit():
        raise ValueError(f"{ENV}={order!r}: use 'reverse' or 'shuffle:SEED' (an integer seed)")
    rng = random.Random(int(seed))
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    names = list(modules)
    rng.shuffle(names)
    shuffled: list[pytest.Item] = []
    for name in names:
        tests = modules[name]
        rng.shuffle(tests)
        shuffled += tests
    return shuffled


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    try:
        items[:] = reorder(items, os.environ.get(ENV, ""))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str | None:
    order = os.environ.get(ENV, "")
    return f"test order: {order} ({ENV})" if order else None

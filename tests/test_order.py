"""tests/order.py: the suite in reverse or shuffled order, modules kept together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.order import reorder

IDS = [f"tests/{m}.py::t{i}" for m in ("a", "b", "c", "d") for i in range(5)]


@dataclass
class Item:
    nodeid: str


def ids(order: str) -> list[str]:
    items: Any = [Item(i) for i in IDS]
    return [item.nodeid for item in reorder(items, order)]


def modules(nodeids: list[str]) -> list[str]:
    return [n.split("::")[0] for n in nodeids]


def test_unset_keeps_pytests_order_and_reverse_reverses_it() -> None:
    assert ids("") == IDS
    assert ids("reverse") == IDS[::-1]


def test_a_shuffle_keeps_each_module_together_and_is_the_same_for_a_seed() -> None:
    shuffled = ids("shuffle:7")
    assert sorted(shuffled) == sorted(IDS) and shuffled != IDS
    runs = [m for i, m in enumerate(modules(shuffled)) if i == 0 or modules(shuffled)[i - 1] != m]
    assert sorted(runs) == ["tests/a.py", "tests/b.py", "tests/c.py", "tests/d.py"]  # once each
    assert ids("shuffle:7") == shuffled
    assert ids("shuffle:8") != shuffled


@pytest.mark.parametrize("bad", ["random", "shuffle", "shuffle:x", "reversed"])
def test_an_unknown_order_says_what_to_use(bad: str) -> None:
    with pytest.raises(ValueError, match=r"use 'reverse' or 'shuffle:SEED'"):
        ids(bad)

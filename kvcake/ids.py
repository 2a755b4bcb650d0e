"""Injectable id generators: deterministic in tests, unique across processes in serving."""

from __future__ import annotations

import itertools
import os
import uuid


class CountingIds:
    """prefix-0, prefix-1, ... : deterministic, for tests and the simulator."""

    def __init__(self, prefix: str = "req") -> None:
        self._prefix = prefix
        self._counter = itertools.count()

    def next_id(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"


class RandomIds:
    """Globally unique ids for live serving."""

    def __init__(self, prefix: str = "req") -> None:
        self._prefix = prefix

    def next_id(self) -> str:
        return f"{self._prefix}-{uuid.UUID(bytes=os.urandom(16)).hex}"

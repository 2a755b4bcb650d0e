"""Fixtures that start a real master (and nodes) on 127.0.0.1 with OS-chosen ports, and stop them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcake.clock import ManualClock
from kvcake.store.config import MasterConfig
from kvcake.store.master import MasterServer, MasterService


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def master(clock: ManualClock) -> Iterator[MasterServer]:
    """A TCP master on a manual clock with no reaper: tests call `service.tick()` themselves."""
    service = MasterService(MasterConfig(heartbeat_timeout_s=10.0, lease_s=5.0), clock)
    server = MasterServer(service, "127.0.0.1", 0, tick_interval_s=None).start()
    yield server
    server.close()

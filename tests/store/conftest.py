"""Fixtures that start a real master (and nodes) on 127.0.0.1 with OS-chosen ports, and stop them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import MasterConfig
from kvcake.store.errors import StoreError
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer


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


def put_then_get_all(client: StoreClient, values: dict[str, bytes]) -> tuple[int, int]:
    """Put every value (a put may fail under faults), then get each back: (served, failed).
    A get either serves exactly the bytes put or fails with a StoreError, never wrong bytes."""
    for key, value in values.items():
        try:
            client.put(key, value)
        except StoreError:
            pass
    served = failed = 0
    for key, value in values.items():
        try:
            got = client.get(key)
        except StoreError:
            failed += 1
            continue
        assert got == value
        served += 1
    return served, failed

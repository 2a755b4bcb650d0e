"""A real `etcd` on 127.0.0.1 (free ports, temporary directory) for the registry and failover
tests; they skip, saying what to install, when no `etcd` binary is on PATH."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest

from kvcake.registry import Etcd
from kvcake.registry.process import EtcdProcess


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdProcess]:
    if shutil.which("etcd") is None:
        pytest.skip("no `etcd` binary on PATH: apt-get install etcd-server (Debian) to run the "
                    "etcd membership and store-failover tests")
    with EtcdProcess() as process:
        yield process


@pytest.fixture
def etcd(etcd_server: EtcdProcess) -> Etcd:
    return Etcd(etcd_server.endpoint)


@pytest.fixture
def cluster() -> str:
    """A cluster name of its own per test, so tests sharing the etcd never see each other."""
    return f"t{uuid.uuid4().hex[:8]}"

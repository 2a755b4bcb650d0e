"""Fixtures for the cross-host tests: three hosts as network namespaces (root only; skipped
with the reason elsewhere) and etcd on host a."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcake.registry.process import EtcdProcess
from tests.multihost.netns import NetnsHosts, NetnsUnavailable


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[NetnsHosts]:
    try:
        built = NetnsHosts(["a", "b", "c"], log_dir=tmp_path).start()
    except NetnsUnavailable as exc:
        pytest.skip(f"cross-host test skipped: {exc}")
    try:
        yield built
    finally:
        built.close()
        for log in sorted(tmp_path.glob("*.log")):  # shown by pytest only when the test fails
            print(f"==== {log.name}\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture
def etcd_on_a(hosts: NetnsHosts) -> Iterator[EtcdProcess]:
    if shutil.which("etcd") is None:
        pytest.skip("cross-host test skipped: no `etcd` binary (apt-get install etcd-server)")
    with EtcdProcess(host=hosts.ip("a"), prefix=["ip", "netns", "exec", hosts.ns("a")]) as etcd:
        try:
            yield etcd
        finally:
            hosts.stop_processes()  # while etcd still answers: they leave cleanly

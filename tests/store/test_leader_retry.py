"""FailoverConnection retries a lost master on whichever leader etcd names next, until one
answers or failover_wait_s has passed (a SIGKILLed leader can accept, then reset)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcake.store import leader
from kvcake.store.errors import MasterUnavailable


class _Resolver:
    def __init__(self, address: str) -> None:
        self.address = address

    def wait(self, wait_s: float) -> str:
        return "10.0.0.1:7000"


class _Conn:
    opened: list[_Conn] = []

    def __init__(self, address: str, timeout_s: float, secret: Any) -> None:
        self.address = address
        self.closed = False
        _Conn.opened.append(self)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_etcd(monkeypatch: pytest.MonkeyPatch) -> list[_Conn]:
    monkeypatch.setattr(leader, "LeaderResolver", _Resolver)
    monkeypatch.setattr(leader, "RpcConnection", _Conn)
    _Conn.opened = []
    return _Conn.opened


def test_a_master_lost_twice_is_retried_on_a_fresh_connection_each_time(
        fake_etcd: list[_Conn]) -> None:
    conn = leader.FailoverConnection("etcd://127.0.0.1:2379/c", failover_wait_s=20.0)
    failures = [MasterUnavailable("reset"), MasterUnavailable("reset again")]

    def attempt(c: Any) -> str:
        if failures:
            raise failures.pop(0)
        return f"answered on connection {fake_etcd.index(c)}"

    assert conn._retry(attempt) == "answered on connection 2"
    assert [c.closed for c in fake_etcd] == [True, True, False]


def test_no_retry_past_the_failover_wait(fake_etcd: list[_Conn]) -> None:
    """The wait runs from the first loss: with 0 s, one fresh connection is tried, then the
    loss is raised."""
    conn = leader.FailoverConnection("etcd://127.0.0.1:2379/c", failover_wait_s=0.0)

    def attempt(c: Any) -> str:
        raise MasterUnavailable("gone")

    with pytest.raises(MasterUnavailable, match="gone"):
        conn._retry(attempt)
    assert len(fake_etcd) == 2


def test_an_attempt_slower_than_the_wait_is_still_retried(
        fake_etcd: list[_Conn], monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt that blocks for its RPC timeout (30 s) before the loss shows does not use up
    a 20 s failover wait: the new leader is still tried."""
    now = [1000.0]
    monkeypatch.setattr(leader.time, "monotonic", lambda: now[0])
    conn = leader.FailoverConnection("etcd://127.0.0.1:2379/c", failover_wait_s=20.0)
    calls: list[int] = []

    def attempt(c: Any) -> str:
        calls.append(fake_etcd.index(c))
        if len(calls) == 1:
            now[0] += 30.0  # the dead leader's socket held the call for the RPC timeout
            raise MasterUnavailable("timed out")
        return f"answered on connection {fake_etcd.index(c)}"

    assert conn._retry(attempt) == "answered on connection 1"
    assert calls == [0, 1]

"""Membership, leases and leader election against a real etcd."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest

from kvcake.registry import (
    Election,
    Etcd,
    EtcdUnavailable,
    KeptLease,
    Member,
    MemberWatch,
    Registration,
    parse_endpoints,
    process,
)
from kvcake.registry.election import leader
from kvcake.registry.members import list_members
from kvcake.registry.process import EtcdProcess, free_port
from tests.net import refused_address

WAIT_S = 10.0  # upper bound on waits for a background thread; events end them early


def test_parse_endpoints() -> None:
    assert parse_endpoints("10.0.0.1:2379,h:2380") == (("10.0.0.1", 2379), ("h", 2380))
    assert parse_endpoints(["http://a:1"]) == (("a", 1),)
    with pytest.raises(ValueError, match="--etcd: expected HOST:PORT"):
        parse_endpoints("nohostport")
    with pytest.raises(ValueError, match="cluster.toml etcd.endpoints"):
        parse_endpoints("a:99999", field="cluster.toml etcd.endpoints")


def test_member_validation_and_roundtrip() -> None:
    member = Member("decode", "d1", "10.0.0.3:9000", model="tiny", fingerprint="abc",
                    extra={"control": "10.0.0.3:9001"})
    assert Member.decode(member.encode()) == member
    with pytest.raises(ValueError, match="role"):
        Member("router", "x", "h:1")
    with pytest.raises(ValueError, match="address"):
        Member("decode", "x", "0.0.0.0")
    with pytest.raises(ValueError, match="member_id"):
        Member("decode", "a/b", "h:1")


def test_unreachable_etcd_names_the_endpoint() -> None:
    with refused_address() as dead, pytest.raises(EtcdUnavailable, match=dead):
        Etcd(dead, timeout_s=1.0).grant(2)


def test_second_endpoint_answers_when_the_first_is_down(etcd: Etcd) -> None:
    with refused_address() as dead:
        both = Etcd(f"{dead},{etcd.text}", timeout_s=1.0)
        both.put("/kvcake/x/two-endpoints", b"1")
        assert both.get("/kvcake/x/two-endpoints") == b"1"


def test_registration_lives_with_its_lease(etcd: Etcd, cluster: str) -> None:
    member = Member("prefill", "p1", "10.0.0.2:7000", model="tiny", fingerprint="f")
    with Registration(etcd, cluster, member):
        assert list(list_members(etcd, cluster).values()) == [member]
        assert list_members(etcd, cluster, "decode") == {}
    assert list_members(etcd, cluster) == {}  # closing revokes the lease: the key is gone


def test_watch_reports_join_leave_and_restart(etcd: Etcd, cluster: str) -> None:
    events: list[tuple[str, str]] = []
    seen = threading.Condition()

    def record(kind: str) -> Callable[[Member], None]:
        def callback(member: Member) -> None:
            with seen:
                events.append((kind, member.address))
                seen.notify_all()
        return callback

    def wait_for(count: int) -> None:
        with seen:
            assert seen.wait_for(lambda: len(events) >= count, WAIT_S), events

    before = Registration(etcd, cluster, Member("decode", "d0", "h:1")).start()
    watch = MemberWatch(etcd, cluster, record("join"), record("leave"), resync_s=1.0).start()
    try:
        wait_for(1)  # present at start: reported as a join
        first = Registration(etcd, cluster, Member("decode", "d1", "h:2")).start()
        wait_for(2)
        first.close()
        wait_for(3)
        # A restart under the same id with a new address: the old one leaves, the new one joins.
        restarted = Registration(etcd, cluster, Member("decode", "d0", "h:3")).start()
        wait_for(5)
        assert events == [("join", "h:1"), ("join", "h:2"), ("leave", "h:2"),
                          ("leave", "h:1"), ("join", "h:3")]
        assert sorted(m.address for m in watch.members.values()) == ["h:3"]
        restarted.close()
    finally:
        watch.close()
        before.close(revoke=False)


def test_lease_lost_is_reported(etcd: Etcd) -> None:
    lost = threading.Event()
    lease = KeptLease(etcd, ttl_s=2, on_lost=lost.set).start()
    assert lease.lease_id is not None
    etcd.revoke(lease.lease_id)  # as if etcd expired it
    assert lost.wait(WAIT_S)
    assert lease.lost
    lease.close()


def test_election_one_leader_and_takeover(etcd: Etcd, cluster: str) -> None:
    key = f"/kvcake/{cluster}/store/leader"
    first_lost = threading.Event()
    first = Election(etcd, key, b"10.0.0.1:5000", on_lost=first_lost.set)
    second = Election(etcd, key, b"10.0.0.2:5000")
    assert first.campaign(timeout_s=5)
    assert not second.try_once()  # one leader at a time
    assert leader(etcd, key) == b"10.0.0.1:5000"
    result: list[bool] = []
    waiting = threading.Thread(target=lambda: result.append(second.campaign(timeout_s=WAIT_S)))
    waiting.start()
    assert first.lease is not None and first.lease.lease_id is not None
    etcd.revoke(first.lease.lease_id)  # the leader dies: its lease ends
    waiting.join(WAIT_S + 5)
    assert result == [True]
    assert leader(etcd, key) == b"10.0.0.2:5000"
    assert first_lost.wait(WAIT_S)  # the old leader learns it no longer leads
    assert not first.leading.is_set() and second.leading.is_set()
    second.resign()
    assert leader(etcd, key) is None
    first.resign()


def test_etcd_is_started_again_when_a_port_picked_for_it_was_taken(
        etcd_server: EtcdProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between picking a free port and etcd binding it, another process may take it: etcd
    exits, and is started again on new ports (not answered for by whoever holds the port)."""
    taken = socket.create_server(("127.0.0.1", 0))  # listening: someone else's server
    picks = iter([taken.getsockname()[1]])
    monkeypatch.setattr(process, "free_port", lambda host="127.0.0.1": next(picks, None)
                        or free_port(host))
    try:
        with EtcdProcess() as again:
            assert again.client_port != taken.getsockname()[1]
            Etcd(again.endpoint).put("/kvcake/x/restarted", b"1")
            assert Etcd(again.endpoint).get("/kvcake/x/restarted") == b"1"
    finally:
        taken.close()

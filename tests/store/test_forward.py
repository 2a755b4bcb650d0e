"""Forwarded slot puts (forward.py): a separate node stores, checks and commits a client's put.

A real TCP master on a manual clock, real nodes with remote-master control; the faults are
injected into the node's forward server (its connection to the master), never by sleeping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvcake.store import StoreClient
from kvcake.store import forward as forward_module
from kvcake.store import writer as writer_module
from kvcake.store.config import NodeConfig
from kvcake.store.errors import (
    InvalidRequest,
    MasterUnavailable,
    ObjectNotFound,
    TransferFailed,
)
from kvcake.store.forward import ForwardLinks, ForwardServer
from kvcake.store.layout import payload_checksum
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.store.protocol import RpcConnection
from kvcake.store.remote import RemoteMaster
from kvcake.transfer import TransferConfig

TCP = TransferConfig(serve=False, use_shared_memory=False, num_rails=2)


@pytest.fixture
def node(master: MasterServer) -> Iterator[StoreNode]:
    node = StoreNode(NodeConfig(4 << 20, heartbeat_interval_s=3600), master.address,
                     node_id="n0", transfer_config=TransferConfig(num_rails=2)).start()
    yield node
    node.close()


class CountingForwards:
    """Counts the node's `put_forward` requests and the commits its sessions send."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forwarded = 0
        original = ForwardServer.put_forward
        counter = self

        def put_forward(server: ForwardServer, session: dict[str, Any],
                        args: dict[str, Any]) -> Any:
            counter.forwarded += 1
            return original(server, session, args)

        monkeypatch.setattr(ForwardServer, "put_forward", put_forward)


def _slot_count(master: MasterServer) -> int:
    return len(master.service.index.slot_table.slots)


def test_a_put_to_a_separate_node_is_forwarded_and_committed_by_it(
        master: MasterServer, node: StoreNode, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingForwards(monkeypatch)
    data = os.urandom(70_000)
    with StoreClient(master.address, transfer_config=TCP, forward_puts=True) as client:
        assert client.put("k0", data) is True  # the first put of a size reserves its slot
        assert client.put("k1", data[::-1]) is True
        assert counting.forwarded == 2
        assert client.put("k1", data) is False  # first write wins; its slot is kept
        assert counting.forwarded == 3
        assert client.get("k1") == data[::-1]
    # Committed at the master (not only in this client's cache): a new client with no cache
    # asks the master and reads the verified bytes from the node.
    with StoreClient(master.address, transfer_config=TCP, location_cache=0) as fresh:
        assert fresh.get("k0") == data and fresh.get("k1") == data[::-1]
    assert master.service.stats()["num_objects"] == 2
    assert _slot_count(master) == 0  # the clients released the slots they held


def test_a_default_client_writes_then_commits_itself(
        master: MasterServer, node: StoreNode, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingForwards(monkeypatch)
    with StoreClient(master.address, transfer_config=TCP) as client:  # forward_puts off
        assert client.put("a", b"x" * 5000) and client.put("b", b"y" * 5000)
        assert client.get("b") == b"y" * 5000
    assert counting.forwarded == 0


def test_a_payload_that_does_not_match_its_checksum_is_refused_and_never_committed(
        master: MasterServer, node: StoreNode, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(9000)
    with StoreClient(master.address, transfer_config=TCP, forward_puts=True) as client:
        assert client.put("warm", data)  # a slot of this size is now held
        monkeypatch.setattr(writer_module, "payload_checksum", lambda view: 12345)
        with pytest.raises(TransferFailed, match="does not match"):
            client.put("bad", data)
        assert not client.exists("bad")
        monkeypatch.undo()
        assert client.put("good", data) and client.get("good") == data  # connection in step
    with StoreClient(master.address, transfer_config=TCP) as fresh, \
            pytest.raises(ObjectNotFound):
        fresh.get("bad")


def test_the_wire_request_is_checked_at_the_node(master: MasterServer, node: StoreNode) -> None:
    remote = RemoteMaster(master.address)
    try:
        (slot,) = remote.put_slots([], [1000, 1, 1, None])["slots"]
        replica = slot["replicas"][0]
        conn = RpcConnection(slot["forward"])
        data = memoryview(os.urandom(1000))
        args = {"key": "w", "slot": slot["slot"], "offset": replica["offset"],
                "version": replica["version"]}
        with pytest.raises(TransferFailed):
            conn.call_with_payload("put_forward", data, checksum=payload_checksum(data) ^ 1,
                                   **args)
        assert not remote.exists("w") and _slot_count(master) == 1
        with pytest.raises(InvalidRequest, match="not inside the segment"):
            conn.call_with_payload("put_forward", data, checksum=payload_checksum(data),
                                   **{**args, "offset": 4 << 20})
        with pytest.raises(InvalidRequest, match="serves only put_forward"):
            conn.call("stats")
        result = conn.call_with_payload("put_forward", data, checksum=payload_checksum(data),
                                        **args)
        assert result["results"] == [{"ok": True, "result": None}]
        assert remote.exists("w") and _slot_count(master) == 0
        conn.close()
        # The master itself refuses the node's op, and its connection stays in step.
        with pytest.raises(InvalidRequest, match="node operation"):
            remote._conn.call_with_payload("put_forward", data,  # type: ignore[union-attr]
                                           checksum=payload_checksum(data), **args)
        assert remote.exists("w")
    finally:
        remote.close()


def _crash_on_commit(monkeypatch: pytest.MonkeyPatch, node: StoreNode, *,
                     after_commit: bool) -> None:
    """The node crashes when it sends a forwarded commit: before the master gets it, or after
    the master committed it but before the client's reply (its ports close, the master sees
    its connection drop)."""
    real = RemoteMaster.put_slots

    def put_slots(self: RemoteMaster, commits: list[Any], reserve: list[Any] | None = None,
                  seal_later: bool = False) -> dict[str, Any]:
        if after_commit:
            real(self, commits, reserve, seal_later)
        node.close(unregister=False)
        raise MasterUnavailable("the node crashed")

    monkeypatch.setattr(forward_module.RemoteMaster, "put_slots", put_slots)


@pytest.mark.parametrize("after_commit", [False, True])
def test_a_node_that_fails_after_storing_before_the_ack_leaves_nothing_readable(
        master: MasterServer, node: StoreNode, monkeypatch: pytest.MonkeyPatch,
        after_commit: bool) -> None:
    data = os.urandom(20_000)
    client = StoreClient(master.address, transfer_config=TCP, forward_puts=True)
    try:
        assert client.put("before", data)
        _crash_on_commit(monkeypatch, node, after_commit=after_commit)
        with pytest.raises(TransferFailed, match="n0"):
            client.put("lost", data)
        monkeypatch.undo()
        # The master drops the node as its registration connection closes: whatever it held,
        # committed or not, is gone; nothing half-written was ever readable.
        master.service.unregister_node("n0")  # (idempotent: not waiting for the close)
        for key in ("before", "lost"):
            with pytest.raises(ObjectNotFound):
                client.get(key)
        assert _slot_count(master) == 0
    finally:
        client.close()


def test_a_commit_that_cannot_reach_the_master_fails_the_put_and_the_next_put_reconnects(
        master: MasterServer, node: StoreNode, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3000)
    real = RemoteMaster.put_slots
    calls = {"n": 0}

    def flaky(self: RemoteMaster, commits: list[Any], reserve: list[Any] | None = None,
              seal_later: bool = False) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:  # the node's link to the master breaks before the second commit
            self.close()
            raise MasterUnavailable("link to the master lost")
        return real(self, commits, reserve, seal_later)

    monkeypatch.setattr(forward_module.RemoteMaster, "put_slots", flaky)
    with StoreClient(master.address, transfer_config=TCP, forward_puts=True) as client:
        assert client.put("one", data)
        with pytest.raises(TransferFailed, match="did not reach the master"):
            client.put("two", data)
        assert not client.exists("two")
        assert client.put("three", data) and client.get("three") == data
    assert calls["n"] == 3


def test_only_single_replica_slots_on_nodes_reached_over_tcp_are_forwarded(
        master: MasterServer, node: StoreNode) -> None:
    other = StoreNode(NodeConfig(4 << 20, heartbeat_interval_s=3600), master.address,
                      node_id="n1", transfer_config=TransferConfig(num_rails=2)).start()
    remote = RemoteMaster(master.address)
    try:
        (one,) = remote.put_slots([], [1000, 1, 1, None])["slots"]
        (two,) = remote.put_slots([], [1000, 1, 2, None])["slots"]
        assert isinstance(one["forward"], str) and "forward" not in two
        segment = one["replicas"][0]["segment"]
        assert ForwardLinks().route(one) == one["forward"]
        assert ForwardLinks().route(two) is None
        assert ForwardLinks(shm_host_id=segment["host_id"]).route(one) is None  # shared memory
        assert ForwardLinks(shm_host_id="another-host").route(one) == one["forward"]
    finally:
        remote.close()
        other.close()

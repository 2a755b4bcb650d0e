"""A store with a cluster secret: master RPC, node control ports and segment servers serve
whoever proves it; a wrong secret or none is refused at connect, logged, and changes nothing."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import MasterConfig, NodeConfig
from kvcake.store.errors import MasterUnavailable
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.store.protocol import RpcConnection, encode, parse_address
from kvcake.transfer import TransferConfig, TransportError
from kvcake.transfer.tcp import TcpTransport

SECRET = ClusterSecret.from_text("store-cluster-secret-0123456789abcdef")
WRONG = ClusterSecret.from_text("some-other-secret-0123456789abcdef012")
SLOT = 100_000


def _tcp(secret: ClusterSecret | None) -> TransferConfig:
    return TransferConfig(serve=False, use_shared_memory=False, num_rails=1, io_timeout_s=5.0,
                          secret=secret)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[MasterServer, StoreNode]]:
    """A master and one node with a disk tier (DRAM for two objects), both with SECRET."""
    service = MasterService(MasterConfig(heartbeat_timeout_s=1e9, lease_s=1.0), ManualClock(0.0))
    master = MasterServer(service, "127.0.0.1", 0, tick_interval_s=None, secret=SECRET).start()
    node = StoreNode(NodeConfig(250_000, str(tmp_path), 1 << 20, heartbeat_interval_s=3600),
                     master.address, node_id="n0", secret=SECRET).start()
    yield master, node
    node.close()
    master.close()


def test_the_right_secret_is_served_on_every_port(secured: tuple[MasterServer, StoreNode]) -> None:
    master, _ = secured
    values = {k: os.urandom(SLOT) for k in "abc"}
    with StoreClient(master.address, transfer_config=_tcp(SECRET)) as client:
        for key, value in values.items():
            client.put(key, value)  # c evicts a: the master demotes it through n0's control port
        assert client.stats()["num_demoted"] == 1  # done, so the control link was admitted
        assert [client.get(k) == v for k, v in values.items()] == [True, True, True]


def test_the_nodes_own_ports_want_the_secret_too(secured: tuple[MasterServer, StoreNode]) -> None:
    _, node = secured
    assert node._control is not None
    with pytest.raises(MasterUnavailable, match="wrong cluster secret"):
        RpcConnection(node._control.address, timeout_s=5.0, secret=WRONG)
    RpcConnection(node._control.address, timeout_s=5.0, secret=SECRET).close()
    address = node.engine.address
    with pytest.raises(TransportError, match="wrong cluster secret"):
        TcpTransport.connect(address, timeout_s=5.0, secret=WRONG)
    transport = TcpTransport.connect(address, timeout_s=5.0, secret=SECRET)
    transport.ping()
    transport.close()


@pytest.mark.parametrize("secret, needle", [(WRONG, "wrong cluster secret"),
                                            (None, "requires the cluster secret")])
def test_a_wrong_or_missing_secret_is_refused_and_changes_nothing(
        secured: tuple[MasterServer, StoreNode], secret: ClusterSecret | None, needle: str,
        caplog: pytest.LogCaptureFixture) -> None:
    master, node = secured
    with StoreClient(master.address, transfer_config=_tcp(SECRET)) as member:
        member.put("k", b"v" * 1000)
        before = bytes(node._view())
        with caplog.at_level(logging.WARNING):
            with pytest.raises(MasterUnavailable, match=needle):
                with StoreClient(master.address, transfer_config=_tcp(secret)) as intruder:
                    intruder.remove("k")
            with pytest.raises(MasterUnavailable, match=needle):
                with StoreClient(master.address, transfer_config=_tcp(secret)) as intruder:
                    intruder.put("j", b"x" * 1000)
        assert member.get("k") == b"v" * 1000 and not member.exists("j")
        assert bytes(node._view()) == before
        assert master.service.stats()["num_objects"] == 1
    assert "refused a kvcake/store-rpc/1 connection" in caplog.text


def test_a_raw_frame_without_the_handshake_is_never_handled(
        secured: tuple[MasterServer, StoreNode]) -> None:
    master, node = secured
    with StoreClient(master.address, transfer_config=_tcp(SECRET)) as member:
        member.put("k", b"v" * 1000)
        frame = encode({"id": 1, "op": "remove", "args": {"key": "k"}})
        frame += encode({"id": 2, "op": "unregister_node", "args": {"node_id": "n0"}}) * 4
        with socket.create_connection(parse_address(master.address), timeout=5.0) as sock:
            sock.sendall(frame)  # well over the answer's 80 bytes: refused without waiting
            assert auth.is_hello(sock.recv(auth.HELLO_BYTES))
            try:
                assert sock.recv(100) == b""  # closed, nothing answered
            except ConnectionResetError:
                pass
        assert member.get("k") == b"v" * 1000
        assert master.service.stats()["num_nodes"] == 1


def test_a_node_with_the_wrong_secret_cannot_join(secured: tuple[MasterServer, StoreNode]
                                                  ) -> None:
    master, _ = secured
    stranger = StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600), master.address,
                         node_id="stranger", secret=WRONG)
    with pytest.raises(MasterUnavailable, match="wrong cluster secret"):
        stranger.start()
    stranger.close()
    assert master.service.stats()["num_nodes"] == 1

"""Store-master failover against a real etcd: two elected masters, nodes and a client that find
the leader through etcd. Killing the leader loses no committed object; an uncommitted put fails
cleanly; a new leader's versions are above the old one's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcake.registry import Etcd, Member, Registration
from kvcake.registry.election import leader
from kvcake.store import StoreClient
from kvcake.store.config import MasterConfig, NodeConfig
from kvcake.store.elected import ElectedMaster
from kvcake.store.errors import ObjectNotFound
from kvcake.store.leader import leader_key
from kvcake.store.node import StoreNode
from kvcake.transfer import TransferConfig

WAIT_S = 15.0


@pytest.fixture
def masters(etcd: Etcd, cluster: str) -> Iterator[tuple[ElectedMaster, ElectedMaster]]:
    config = MasterConfig(heartbeat_timeout_s=30.0)
    first = ElectedMaster(etcd, cluster, config, recovery_s=WAIT_S).start()
    assert first.ready.wait(WAIT_S)
    second = ElectedMaster(etcd, cluster, config, recovery_s=WAIT_S).start()
    yield first, second
    second.close()
    first.close()


def _node(etcd: Etcd, cluster: str, name: str) -> tuple[StoreNode, Registration]:
    node = StoreNode(NodeConfig(dram_bytes=1 << 20, heartbeat_interval_s=0.05),
                     f"etcd://{etcd.text}/{cluster}", node_id=name,
                     transfer_config=TransferConfig(use_shared_memory=False)).start()
    member = Member("store_node", name, node.engine.address)
    return node, Registration(etcd, cluster, member).start()


def test_leader_dies_committed_objects_survive(etcd: Etcd, cluster: str,
                                               masters: tuple[ElectedMaster, ElectedMaster]
                                               ) -> None:
    first, second = masters
    assert first.leading and not second.leading
    assert leader(etcd, leader_key(cluster)) == first.address.encode()
    nodes = [_node(etcd, cluster, f"n{i}") for i in range(2)]
    client = StoreClient(f"etcd://{etcd.text}/{cluster}",
                         transfer_config=TransferConfig(serve=False, use_shared_memory=False))
    try:
        values = {f"k{i}": bytes([i]) * (100 + 37 * i) for i in range(12)}
        for key, value in values.items():
            client.put(key, value)
        client.remove("k11")  # removed before the failover: must not come back
        del values["k11"]
        pending = client.master.put_start("uncommitted", 64, None, 1, None)
        old_version = max(d["version"] for d in pending)

        first.close(crash=True)  # killed: no resign, its lease still runs...
        assert first.election is not None and first.election.lease is not None
        assert first.election.lease.lease_id is not None
        etcd.revoke(first.election.lease.lease_id)  # ...until etcd expires it

        assert second.ready.wait(WAIT_S)
        assert second.leading
        assert leader(etcd, leader_key(cluster)) == second.address.encode()
        for key, value in values.items():  # the client follows the new leader by itself
            assert client.get(key) == value, key
        assert not client.exists("k11")
        assert second.service.stats()["num_objects"] == len(values)
        with pytest.raises(ObjectNotFound, match="no put in progress"):
            client.master.put_commit("uncommitted", 0)  # not committed: fails cleanly
        client.put("after", b"new bytes")
        assert client.get("after") == b"new bytes"
        new_version = second.service.index.objects["after"].replicas[0].version
        assert new_version > old_version
    finally:
        client.close()
        for node, registration in nodes:
            registration.close()
            node.close()


def test_node_catalogue_drops_stale_entries(etcd: Etcd, cluster: str,
                                            masters: tuple[ElectedMaster, ElectedMaster]) -> None:
    node, registration = _node(etcd, cluster, "solo")
    client = StoreClient(f"etcd://{etcd.text}/{cluster}",
                         transfer_config=TransferConfig(serve=False, use_shared_memory=False))
    try:
        client.put("a", b"x" * 200)
        client.put("b", b"y" * 200)
        client.remove("b")
        # The mirror frames are one-way: a get on the same master orders after them on the
        # master side, and the node's control connection delivers them in order.
        held = {e[0]: e for e in node.held_objects()}
        assert set(held) <= {"a", "b"}
        entry = masters[0].service.index.objects["a"].replicas[0]
        view = node.engine.segment(f"store-{node.node_id}").view
        view[entry.offset + 40] ^= 0xFF  # corrupt a's payload in place
        assert all(e[0] != "a" for e in node.held_objects())  # not offered to a new master
    finally:
        client.close()
        registration.close()
        node.close()


def test_a_leader_that_loses_its_lease_stops_serving(etcd: Etcd, cluster: str,
                                                     masters: tuple[ElectedMaster, ElectedMaster]
                                                     ) -> None:
    from kvcake.store.errors import MasterUnavailable
    from kvcake.store.protocol import RpcConnection

    first, second = masters
    conn = RpcConnection(first.address)
    assert conn.call("stats")["num_nodes"] == 0  # serving now
    conn.close()
    assert first.election is not None and first.election.lease is not None
    assert first.election.lease.lease_id is not None
    etcd.revoke(first.election.lease.lease_id)  # e.g. partitioned from etcd for a TTL
    assert first.lost.wait(WAIT_S)
    assert second.ready.wait(WAIT_S) and second.leading
    with pytest.raises(MasterUnavailable):
        RpcConnection(first.address, timeout_s=2.0).call("stats")

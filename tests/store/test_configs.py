"""`ClientConfig`, `ElectionConfig` and `NodeConfig` (config.py): validated, and given either whole
or as the constructor keywords `StoreClient`, `ElectedMaster` and `StoreNode` always took
(`override`)."""

from __future__ import annotations

import threading

import pytest

from kvcake.registry import Etcd
from kvcake.store import StoreClient
from kvcake.store.config import (
    CACHE_ENTRIES,
    ClientConfig,
    ElectionConfig,
    EmbeddedConfig,
    NodeConfig,
    override,
)
from kvcake.store.elected import ElectedMaster
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.master import MasterService
from kvcake.store.master_server import ReadyGate
from kvcake.store.node import StoreNode


@pytest.mark.parametrize("bad, field", [
    ({"num_replicas": 0}, "num_replicas"),
    ({"location_cache": -1}, "location_cache"),
])
def test_a_client_config_names_the_field_to_change(bad: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ClientConfig(**bad)


@pytest.mark.parametrize("bad, field", [
    ({"port": -1}, "port"),
    ({"port": 65536}, "port"),
    ({"recovery_s": -0.5}, "recovery_s"),
    ({"lease_ttl_s": 0}, "lease_ttl_s"),
    ({"tick_interval_s": 0.0}, "tick_interval_s"),
    ({"host": ""}, "host"),
])
def test_an_election_config_names_the_field_to_change(bad: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ElectionConfig(**bad)  # type: ignore[arg-type]


def test_from_dict_and_override_reject_unknown_keys_and_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['replicas'\].*num_replicas"):
        ClientConfig.from_dict({"replicas": 2})
    with pytest.raises(ValueError, match=r"unknown keys \['ttl_s'\].*lease_ttl_s"):
        override(ElectionConfig(), {"ttl_s": 3})
    assert ElectionConfig.from_dict({"tick_interval_s": None}).tick_interval_s is None


def test_override_replaces_only_the_named_fields_and_validates_again() -> None:
    base = ClientConfig(num_replicas=2, location_cache=7)
    assert override(base, {}) is base
    assert override(base, {"async_seal": True}) == ClientConfig(2, None, 7, True)
    with pytest.raises(ValueError, match="num_replicas"):
        override(base, {"num_replicas": 0})


def test_a_store_client_takes_a_config_or_its_fields_as_keywords() -> None:
    store = EmbeddedStore(EmbeddedConfig(1 << 20))
    whole = StoreClient(store.master, ClientConfig(num_replicas=1, local_node="node-0"),
                        engine=store.engine)
    keywords = StoreClient(store.master, engine=store.engine, num_replicas=1,
                           local_node="node-0")
    mixed = StoreClient(store.master, ClientConfig(location_cache=0), engine=store.engine,
                        async_seal=True)
    try:
        assert whole.config == keywords.config == ClientConfig(1, "node-0", CACHE_ENTRIES)
        assert (keywords.num_replicas, keywords.local_node) == (1, "node-0")
        assert mixed.config == ClientConfig(location_cache=0, async_seal=True)
        with pytest.raises(ValueError, match=r"unknown keys \['replicas'\]"):
            StoreClient(store.master, engine=store.engine, replicas=2)
    finally:
        for client in (whole, keywords, mixed):
            client.close()


def test_an_elected_master_takes_an_election_config_or_its_fields_as_keywords() -> None:
    etcd = Etcd("127.0.0.1:2379")  # never dialled: nothing is started
    keywords = ElectedMaster(etcd, "c", host="127.0.0.2", recovery_s=3.0, tick_interval_s=None)
    whole = ElectedMaster(etcd, "c", None, ElectionConfig(host="127.0.0.2", recovery_s=3.0,
                                                          tick_interval_s=None))
    for master in (keywords, whole):
        assert (master._advertise_host, master._recovery_s, master._lease_ttl_s) == \
            ("127.0.0.2", 3.0, 2)
    with pytest.raises(ValueError, match=r"unknown keys \['recovery'\]"):
        ElectedMaster(etcd, "c", recovery=3.0)


def test_a_store_node_takes_its_address_as_config_fields_or_keywords() -> None:
    service = MasterService()  # an in-process master: nothing is bound until start()
    keywords = StoreNode(NodeConfig(1 << 20), service, host="127.0.0.2",
                         advertise_host="10.0.0.1")
    whole = StoreNode(NodeConfig(1 << 20, host="127.0.0.2", advertise_host="10.0.0.1"), service)
    for node in (keywords, whole):
        assert node.config == NodeConfig(1 << 20, host="127.0.0.2", advertise_host="10.0.0.1")
        assert node._host == "127.0.0.2" and node._advertise_host == "10.0.0.1"
        node.engine.close()
    with pytest.raises(ValueError, match=r"unknown keys \['bind'\]"):
        StoreNode(NodeConfig(1 << 20), service, bind="0.0.0.0")
    with pytest.raises(ValueError, match="host"):
        NodeConfig(1 << 20, host="")
    with pytest.raises(ValueError, match="advertise_host"):
        NodeConfig(1 << 20, advertise_host="")


def test_a_ready_gate_needs_a_positive_wait() -> None:
    assert ReadyGate().wait_s == 30.0 and not ReadyGate().event.is_set()
    with pytest.raises(ValueError, match="wait_s"):
        ReadyGate(threading.Event(), 0.0)

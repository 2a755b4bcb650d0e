"""The store across hosts (network namespaces): two elected masters on hosts a and b, nodes on b
and c, a client on the root namespace; every byte crosses a veth over TCP. Killing the leader
(SIGKILL) loses no committed object, and the client follows the new leader by itself (a put
after the kill waits for it; gets of objects the client remembers need no master)."""

from __future__ import annotations

import sys
import time

import numpy as np

from kvcake.registry import Etcd
from kvcake.registry.members import list_members
from kvcake.store import StoreClient
from kvcake.store.leader import leader_key
from kvcake.transfer import TransferConfig
from tests.multihost.netns import NetnsHosts

CLUSTER = "xhost"
KVCAKE_STORE = [sys.executable, "-m", "kvcake.store"]


def wait_until(condition: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_store_master_failover_across_hosts(hosts: NetnsHosts, etcd_on_a: object) -> None:
    endpoint = etcd_on_a.endpoint  # type: ignore[attr-defined]
    etcd = Etcd(endpoint)
    common = ["--etcd", endpoint, "--cluster", CLUSTER]
    masters = {h: hosts.spawn(h, [*KVCAKE_STORE, "master", "--host", hosts.ip(h), "--port", "0",
                                  "--recovery-s", "10", *common], name=f"master-{h}")
               for h in ("a", "b")}
    wait_until(lambda: etcd.get(leader_key(CLUSTER)) is not None)
    first = etcd.get(leader_key(CLUSTER)).decode()  # type: ignore[union-attr]
    first_host = next(h for h in ("a", "b") if first.startswith(hosts.ip(h) + ":"))
    for h in ("b", "c"):
        hosts.spawn(h, [*KVCAKE_STORE, "node", "--dram", "16MiB", "--host", hosts.ip(h),
                        "--node-id", f"node-{h}", "--heartbeat-interval-s", "0.2", *common],
                    name=f"node-{h}")
    wait_until(lambda: len(list_members(etcd, CLUSTER, "store_node")) == 2)
    client = StoreClient(f"etcd://{endpoint}/{CLUSTER}", num_replicas=1,
                         transfer_config=TransferConfig(serve=False, use_shared_memory=False))
    try:
        rng = np.random.default_rng(7)
        values = {f"obj-{i}": rng.integers(0, 256, 1000 + 40_000 * (i % 4), dtype=np.uint8)
                  .tobytes() for i in range(16)}
        wait_until(lambda: client.master.stats()["num_nodes"] == 2)
        for key, value in values.items():
            client.put(key, value)
        holders = {r["node_id"] for key in values for r in client.master.get(key)["replicas"]}
        assert holders == {"node-b", "node-c"}  # objects on both remote hosts

        killed_at = time.monotonic()
        masters[first_host].kill()  # SIGKILL: no resign, its lease runs out in etcd
        # a put needs the master (a get may not: the client remembers where its objects live),
        # so this waits for the new leader and retries
        client.put("after-failover", b"z" * 5000)
        without_master_s = time.monotonic() - killed_at
        second = etcd.get(leader_key(CLUSTER)).decode()  # type: ignore[union-attr]
        assert second != first and not second.startswith(hosts.ip(first_host) + ":")
        for key, value in values.items():  # the new leader knows every committed object
            assert {r["node_id"] for r in client.master.get(key)["replicas"]} <= holders, key
            assert client.get(key) == value, key
        assert client.get("after-failover") == b"z" * 5000
        print(f"store master failover across hosts: {without_master_s:.2f} s without a master "
              f"({len(values)} objects, all read back)")
        assert without_master_s < 30.0
    finally:
        client.close()

"""A worker joining a cluster through etcd (`kvcake worker --etcd HOST:PORT`).

`join()` first checks that the worker answers at the address it advertises (`--advertise-host`
and its control port; a typo or an address of another host fails here, with what to change,
rather than at the frontend), then registers it, and its store node, under one kept lease each:

    /kvcake/<cluster>/members/<role>/<worker_id>   = Member(role, HOST:PORT, model, namespace)
    /kvcake/<cluster>/members/store_node/<node_id> = Member(store_node, segment server address)

The frontend (cluster/membership.py) connects to it when the key appears; the key goes when the
process dies (the lease is no longer renewed) or leaves (`close()` revokes it).
"""

from __future__ import annotations

import socket
import uuid
from typing import Protocol

from kvcake.registry import Etcd, Member, Registration
from kvcake.store.protocol import parse_address


class Joinable(Protocol):
    """What `join` needs of a worker (worker.Worker)."""

    worker_id: str

    @property
    def address(self) -> str: ...


def advertised(bind_address: str, advertise_host: str | None) -> str:
    """HOST:PORT peers dial: the advertised host with the bound port. A wildcard bind address
    without `advertise_host` is an error saying what to give."""
    host, port = parse_address(bind_address, "bind address")
    if advertise_host:
        return f"{advertise_host}:{port}"
    if host in ("0.0.0.0", "::"):
        raise ValueError(f"--advertise-host: the worker binds {host} (every address); give the "
                         "address other hosts should dial")
    return bind_address


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """ValueError unless a TCP connection to `address` succeeds from this host."""
    host, port = parse_address(address, "--advertise-host")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ValueError(f"--advertise-host: this worker cannot be reached at {address} "
                         f"({exc}); give an address of this host that the other hosts can "
                         "dial") from None


class WorkerMembership:
    def __init__(self, etcd: Etcd, cluster: str, role: str, model: str, namespace: str,
                 ttl_s: int = 3) -> None:
        self.etcd = etcd
        self.cluster = cluster
        self.role = role
        self.model = model
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.registrations: list[Registration] = []

    def join(self, worker: Joinable, advertise_host: str | None,
             store_node: tuple[str, str] | None = None) -> str:
        """Register `worker` (and its store node: (node id, segment server address)); returns
        the address it advertises. ValueError when it is not reachable there."""
        address = advertised(worker.address, advertise_host)
        check_reachable(address)
        # A new process under the same id and address still differs from the old one
        # (`incarnation`), so a watcher sees the restart even with a fixed --port.
        member = Member(self.role, worker.worker_id, address, model=self.model,
                        fingerprint=self.namespace, extra={"incarnation": uuid.uuid4().hex})
        self.registrations.append(Registration(self.etcd, self.cluster, member,
                                               self.ttl_s).start())
        if store_node is not None:
            node = Member("store_node", store_node[0], store_node[1], model=self.model)
            self.registrations.append(Registration(self.etcd, self.cluster, node,
                                                   self.ttl_s).start())
        return address

    def close(self) -> None:
        for registration in self.registrations:
            registration.close()
        self.registrations.clear()

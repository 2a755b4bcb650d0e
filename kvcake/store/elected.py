"""`ElectedMaster`: a store master that leads only while etcd says so (`kvcake store master
--etcd`).

    standby -> elected (lease + create transaction, registry/election.py) -> recovering -> serving
                                                                 lease lost -> stopped

Every candidate serves its RPC port from the start, but only the leader's address is in etcd, so
clients and nodes (`store/leader.py`) reach only the leader. Once elected it hands out versions
above any earlier leader's (the etcd revision, shifted), and while the store nodes listed in etcd
re-register with their committed objects (rebuild.py) it holds client requests back, for at most
`recovery_s`. A leader that loses its lease stops serving at once (`lost` is set): another may
lead by then.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvcake.auth import ClusterSecret
from kvcake.registry import Election, Etcd
from kvcake.registry.members import list_members
from kvcake.store.config import ElectionConfig, MasterConfig, override
from kvcake.store.leader import leader_key
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer, ReadyGate

log = logging.getLogger(__name__)


class ElectedMaster:
    """A candidate master of `cluster` in `etcd`, with policy `config`. `election`
    (`ElectionConfig`): where it serves and how it stands; its fields may also be given as
    keywords (`recovery_s=5.0`), which override those of `election`. `secret`: only peers that
    prove it are served."""

    def __init__(self, etcd: Etcd, cluster: str, config: MasterConfig | None = None,
                 election: ElectionConfig | None = None, *,
                 secret: ClusterSecret | None = None, **options: Any) -> None:
        election = override(election or ElectionConfig(), options)
        self.etcd = etcd
        self.cluster = cluster
        self.ready = threading.Event()
        self.lost = threading.Event()
        self.service = MasterService(config, mirror=True)
        self.server = MasterServer(self.service, election.host, election.port,
                                   tick_interval_s=election.tick_interval_s, secret=secret,
                                   ready=ReadyGate(self.ready))
        self._advertise_host = election.advertise_host or election.host
        self._recovery_s = election.recovery_s
        self._lease_ttl_s = election.lease_ttl_s
        self.address = ""
        self.election: Election | None = None
        self.elected_at_s: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def leading(self) -> bool:
        return self.election is not None and self.election.leading.is_set()

    def start(self) -> ElectedMaster:
        self.server.start()
        self.address = f"{self._advertise_host}:{self.server.address.rpartition(':')[2]}"
        self.election = Election(self.etcd, leader_key(self.cluster), self.address.encode(),
                                 ttl_s=self._lease_ttl_s, on_lost=self._on_lost)
        self._thread = threading.Thread(target=self._run, name="store-master-election",
                                        daemon=True)
        self._thread.start()
        log.info("master %s standing by for cluster %r (etcd %s)", self.address, self.cluster,
                 self.etcd.text)
        return self

    def close(self, crash: bool = False) -> None:
        """Stop; `crash=True` leaves the leadership key to expire with the lease, as a killed
        process would (tests), instead of resigning."""
        self._stop.set()
        if self.election is not None:
            self.election.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.election is not None:
            if crash:
                assert self.election.lease is not None
                self.election.lease.close(revoke=False)
            else:
                self.election.resign()
        self.server.close()

    def __enter__(self) -> ElectedMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_lost(self) -> None:
        log.error("master %s lost its etcd lease: it stops serving (another may lead now)",
                  self.address)
        self.lost.set()
        self.ready.clear()
        self.server.close()

    def _run(self) -> None:
        assert self.election is not None
        while not self._stop.is_set():
            if self.election.campaign(timeout_s=1.0):
                break
        if self._stop.is_set():
            return
        self.elected_at_s = time.monotonic()
        _, revision = self.etcd.list_prefix(leader_key(self.cluster))
        self.service.index.space.raise_version_floor(revision << 32)
        nodes = {m.member_id for m in
                 list_members(self.etcd, self.cluster, "store_node").values()}
        log.info("master %s elected (etcd revision %d); waiting for %d store nodes",
                 self.address, revision, len(nodes))
        deadline_s = time.monotonic() + self._recovery_s
        while not self._stop.is_set() and time.monotonic() < deadline_s:
            if nodes <= set(self.service.index.nodes):
                break
            self._stop.wait(0.02)
        self.ready.set()
        stats = self.service.stats()
        log.info("master %s serving: %d of %d nodes back, %d objects recovered", self.address,
                 len(nodes & set(self.service.index.nodes)), len(nodes), stats["num_objects"])

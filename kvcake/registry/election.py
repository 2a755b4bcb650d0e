"""`Election`: one leader per name, as an etcd key created in a transaction under the leader's
kept lease (no consensus of our own: etcd's Raft decides, the transaction makes the create
atomic). The key's value is what followers need of the leader (its advertised address).

    election = Election(etcd, "/kvcake/c/store/leader", b"10.0.0.1:50051")
    election.campaign()        # blocks until this process leads
    ...                        # lead; `on_lost` fires if the lease is lost (stop leading then)
    election.resign()

A leader that dies stops renewing; etcd deletes the key one TTL later and a waiting candidate's
transaction succeeds. `leader(etcd, key)` tells anyone who leads now.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvcake.registry.etcd import Etcd, EtcdUnavailable
from kvcake.registry.lease import KeptLease

log = logging.getLogger(__name__)


def leader(etcd: Etcd, key: str) -> bytes | None:
    """The current leader's value, or None while nobody leads."""
    return etcd.get(key)


class Election:
    def __init__(self, etcd: Etcd, key: str, value: bytes, ttl_s: int = 2,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.etcd = etcd
        self.key = key
        self.value = value
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self.lease: KeptLease | None = None
        self.leading = threading.Event()
        self._stop = threading.Event()

    def try_once(self) -> bool:
        """One attempt: True if this process leads now."""
        if self.lease is None or self.lease.lost:
            self.lease = KeptLease(self.etcd, self.ttl_s, self._lost).start()
        assert self.lease.lease_id is not None
        created, _ = self.etcd.create(self.key, self.value, self.lease.lease_id)
        if created:
            self.leading.set()
            log.info("elected: %s = %s", self.key, self.value.decode(errors="replace"))
            return True
        return False

    def campaign(self, timeout_s: float | None = None) -> bool:
        """Wait until elected (True) or `timeout_s` / `cancel()` (False). Between attempts it
        waits for the key to change, so a takeover follows the old lease's expiry at once."""
        waited_s = 0.0
        while not self._stop.is_set():
            try:
                if self.try_once():
                    return True
                _, revision = self.etcd.list_prefix(self.key)
                step_s = 1.0 if timeout_s is None else max(0.05, min(1.0, timeout_s - waited_s))
                self.etcd.wait_change(self.key, revision + 1, step_s)
                waited_s += step_s
            except EtcdUnavailable as exc:
                log.warning("election %s: %s", self.key, exc)
                self._stop.wait(0.5)
                waited_s += 0.5
            if timeout_s is not None and waited_s >= timeout_s:
                return False
        return False

    def cancel(self) -> None:
        self._stop.set()

    def resign(self) -> None:
        """Give up leadership (the key goes now, not one TTL later) and the lease."""
        self._stop.set()
        if self.leading.is_set():
            try:
                self.etcd.delete_if_value(self.key, self.value)
            except EtcdUnavailable as exc:
                log.warning("resign %s: %s (the key expires with the lease)", self.key, exc)
        self.leading.clear()
        if self.lease is not None:
            self.lease.close()

    def _lost(self) -> None:
        was_leading = self.leading.is_set()
        self.leading.clear()
        if was_leading and self._on_lost is not None:
            self._on_lost()

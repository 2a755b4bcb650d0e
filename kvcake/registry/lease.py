"""`KeptLease`: an etcd lease renewed by a thread every third of its TTL.

Whatever is put under the lease lives as long as this process keeps it: a crashed or hung
process stops renewing, and etcd deletes its keys one TTL later. If a renewal finds the lease
gone, or etcd stays unreachable for a whole TTL, the lease is lost: `on_lost` runs once (a
leader must then stop acting as one) and the thread ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvcake.registry.etcd import Etcd, EtcdUnavailable

log = logging.getLogger(__name__)


class KeptLease:
    def __init__(self, etcd: Etcd, ttl_s: int = 3,
                 on_lost: Callable[[], None] | None = None) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s: an etcd lease lives at least 1 s, got {ttl_s}")
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.lease_id: int | None = None
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def start(self) -> KeptLease:
        self.lease_id = self.etcd.grant(self.ttl_s)
        self._thread = threading.Thread(target=self._keep, name=f"lease-{self.lease_id:x}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self, revoke: bool = True) -> None:
        """Stop renewing; `revoke` deletes the lease's keys now (a clean exit) instead of one
        TTL later (as a crash would)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.ttl_s + 5)
        if revoke and self.lease_id is not None and not self.lost:
            try:
                self.etcd.revoke(self.lease_id)
            except EtcdUnavailable as exc:
                log.warning("lease %x: could not revoke (%s); it expires in %d s",
                            self.lease_id, exc, self.ttl_s)

    def __enter__(self) -> KeptLease:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keep(self) -> None:
        assert self.lease_id is not None
        last_ok_s = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.etcd.keepalive(self.lease_id) > 0:
                    last_ok_s = time.monotonic()
                    continue
                reason = "etcd says it expired"
            except EtcdUnavailable as exc:
                if time.monotonic() - last_ok_s < self.ttl_s:
                    log.warning("lease %x: renewal failed (%s); retrying", self.lease_id, exc)
                    continue
                reason = f"etcd unreachable for a whole TTL ({exc})"
            log.error("lease %x lost: %s", self.lease_id, reason)
            self._lost.set()
            if self._on_lost is not None:
                self._on_lost()
            return

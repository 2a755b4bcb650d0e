"""Finding the store master through etcd, and following it across a failover.

A master address "etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]" names no master but the etcd that
knows the elected one (`kvcake store master --etcd`, key `leader_key(cluster)`).
`FailoverConnection` has the interface of `RpcConnection`; when the master it talks to is gone
(MasterUnavailable), it waits for the current leader (up to `failover_wait_s`), reconnects and
retries the operation once. A retried put_start allocates anew on the new leader; a put_commit
of a put the old leader started fails cleanly there (no put in progress): uncommitted puts are
not carried over, committed objects are (rebuild.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvcake.auth import ClusterSecret
from kvcake.store.errors import MasterUnavailable
from kvcake.store.protocol import RpcConnection

T = TypeVar("T")
log = logging.getLogger(__name__)
SCHEME = "etcd://"
DEFAULT_CLUSTER = "kvcake"


def leader_key(cluster: str) -> str:
    return f"/kvcake/{cluster}/store/master"


def parse_etcd_address(address: str) -> tuple[str, str]:
    """"etcd://ENDPOINTS[/CLUSTER]" -> (endpoints, cluster)."""
    rest = address.removeprefix(SCHEME)
    endpoints, _, cluster = rest.partition("/")
    if not endpoints:
        raise ValueError(f"master: expected etcd://HOST:PORT[/CLUSTER], got {address!r}")
    return endpoints, cluster or DEFAULT_CLUSTER


class LeaderResolver:
    """The elected master's address, read from etcd."""

    def __init__(self, address: str) -> None:
        from kvcake.registry import Etcd  # only the etcd setups import the etcd client

        endpoints, self.cluster = parse_etcd_address(address)
        self.etcd = Etcd(endpoints)
        self.key = leader_key(self.cluster)

    def current(self) -> str | None:
        from kvcake.registry import EtcdUnavailable

        try:
            value = self.etcd.get(self.key)
        except EtcdUnavailable as exc:
            log.warning("store master lookup: %s", exc)
            return None
        return value.decode() if value else None

    def wait(self, wait_s: float) -> str:
        """The leader's address, waiting up to `wait_s` for one to be elected."""
        deadline = time.monotonic() + wait_s
        while True:
            address = self.current()
            if address is not None:
                return address
            if time.monotonic() >= deadline:
                raise MasterUnavailable(f"no store master elected in etcd {self.etcd.text} "
                                        f"(key {self.key}) within {wait_s:.0f} s: is "
                                        "`kvcake store master --etcd` running?")
            time.sleep(0.1)


class FailoverConnection:
    """`RpcConnection` to whichever master etcd names; retried on the new leader after a loss."""

    def __init__(self, address: str, timeout_s: float = 30.0,
                 secret: ClusterSecret | None = None, failover_wait_s: float = 20.0) -> None:
        self.address = address
        self._resolver = LeaderResolver(address)
        self._timeout_s = timeout_s
        self._secret = secret
        self._failover_wait_s = failover_wait_s
        self._lock = threading.Lock()
        self._conn: RpcConnection | None = None
        self._connect()

    @property
    def master_address(self) -> str:
        return self._conn.address if self._conn is not None else ""

    def _connect(self) -> RpcConnection:
        deadline = time.monotonic() + self._failover_wait_s
        while True:
            leader = self._resolver.wait(max(0.0, deadline - time.monotonic()))
            try:
                self._conn = RpcConnection(leader, self._timeout_s, self._secret)
                return self._conn
            except MasterUnavailable:
                # the key may still name a dead leader until its lease expires
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _retry(self, attempt: Callable[[RpcConnection], T]) -> T:
        """`attempt` on the leader's connection; on a lost master, on the leader etcd names
        next, until one answers or `failover_wait_s` has passed. Retried more than once: right
        after a SIGKILL etcd still names the dead leader, whose socket may accept and then reset."""
        with self._lock:
            conn = self._conn or self._connect()
        deadline: float | None = None  # failover_wait_s from the first loss, not from the call:
        retries = 0                    # an attempt may block for its RPC timeout before failing
        while True:
            try:
                return attempt(conn)
            except MasterUnavailable as exc:
                if deadline is None:
                    deadline = time.monotonic() + self._failover_wait_s
                elif time.monotonic() >= deadline:
                    raise
                log.warning("store master %s lost (%s): finding the new leader", conn.address, exc)
                if retries:
                    time.sleep(0.1)
                retries += 1
                with self._lock:
                    if self._conn is conn:
                        conn.close()
                        self._conn = None
                    conn = self._conn or self._connect()

    def call(self, op: str, **args: Any) -> Any:
        return self._retry(lambda c: c.call(op, **args))

    def call_overlapped(self, op: str, args: dict[str, Any], work: Callable[[], T]
                        ) -> tuple[Any, T]:
        done: list[T] = []

        def once() -> T:  # work runs once, whichever attempt runs it
            if not done:
                done.append(work())
            return done[0]

        return self._retry(lambda c: c.call_overlapped(op, args, once))

    def send(self, op: str, **args: Any) -> None:
        self._retry(lambda c: c.send(op, **args))

    def defer(self, op: str, **args: Any) -> None:
        """Deferred one-way frames (lease releases) die with their master: its leases did."""
        with self._lock:
            conn = self._conn
        if conn is not None:
            conn.defer(op, **args)

    def defer_items(self, op: str, field: str, items: list[Any]) -> None:
        with self._lock:
            conn = self._conn
        if conn is not None:
            conn.defer_items(op, field, items)

    def flush(self) -> None:
        with self._lock:
            conn = self._conn
        if conn is not None:
            try:
                conn.flush()
            except MasterUnavailable:
                pass

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def connect(address: str, timeout_s: float, secret: ClusterSecret | None
            ) -> RpcConnection | FailoverConnection:
    """A connection to the master at "HOST:PORT", or to the one etcd names ("etcd://...")."""
    if address.startswith(SCHEME):
        return FailoverConnection(address, timeout_s, secret)
    return RpcConnection(address, timeout_s, secret)

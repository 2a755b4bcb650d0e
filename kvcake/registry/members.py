"""Members of a cluster in etcd: each worker and store node keeps one key alive under its lease,

    /kvcake/<cluster>/members/<role>/<member_id> = JSON Member

and anyone (the frontend, a new store master) lists them or watches them come and go.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcake.registry.etcd import Etcd, EtcdUnavailable
from kvcake.registry.lease import KeptLease

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "store_node")


def members_prefix(cluster: str, role: str | None = None) -> str:
    base = f"/kvcake/{cluster}/members/"
    return base if role is None else f"{base}{role}/"


@dataclass(frozen=True)
class Member:
    """What a peer needs to use a member: its role, the address others dial (`address`, the
    advertised one, not the bind address), and what it serves (`model` plus `fingerprint`, a
    digest of the model and KV layout: a frontend admits only members that match its own)."""

    role: str
    member_id: str
    address: str
    model: str = ""
    fingerprint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.member_id or "/" in self.member_id:
            raise ValueError(f"member_id: a non-empty name without '/', got {self.member_id!r}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address: HOST:PORT that peers can dial, got {self.address!r}")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes) -> Member:
        return Member(**json.loads(data))


class Registration:
    """A member's key, kept alive by its own lease; `close()` deletes it at once."""

    def __init__(self, etcd: Etcd, cluster: str, member: Member, ttl_s: int = 3,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.member = member
        self.key = members_prefix(cluster, member.role) + member.member_id
        self.lease = KeptLease(etcd, ttl_s, on_lost)
        self._etcd = etcd

    def start(self) -> Registration:
        self.lease.start()
        assert self.lease.lease_id is not None
        self._etcd.put(self.key, self.member.encode(), self.lease.lease_id)
        log.info("registered %s in etcd as %s", self.member.address, self.key)
        return self

    def close(self, revoke: bool = True) -> None:
        self.lease.close(revoke=revoke)

    def __enter__(self) -> Registration:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def list_members(etcd: Etcd, cluster: str, role: str | None = None) -> dict[str, Member]:
    """The members registered now, by key (entries that do not decode are skipped, logged)."""
    items, _ = etcd.list_prefix(members_prefix(cluster, role))
    return _decode_all(items)


def _decode_all(items: dict[str, bytes]) -> dict[str, Member]:
    out = {}
    for key, value in items.items():
        try:
            out[key] = Member.decode(value)
        except (ValueError, TypeError) as exc:
            log.warning("etcd key %s holds no valid member (%s): ignored", key, exc)
    return out


class MemberWatch:
    """Calls `on_join(member)` for every member that appears under the prefix (those present at
    start too) and `on_leave(member)` for every one that goes, from one thread. A member whose
    value changes (a restart under the same id) leaves, then joins. Lists, then waits for a
    change from the listed revision on, so no change is missed; also lists every `resync_s`."""

    def __init__(self, etcd: Etcd, cluster: str, on_join: Callable[[Member], None],
                 on_leave: Callable[[Member], None], role: str | None = None,
                 resync_s: float = 2.0) -> None:
        self._etcd = etcd
        self._prefix = members_prefix(cluster, role)
        self._on_join = on_join
        self._on_leave = on_leave
        self._resync_s = resync_s
        self._known: dict[str, Member] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()  # set after the first listing was reported

    @property
    def members(self) -> dict[str, Member]:
        return dict(self._known)

    def start(self) -> MemberWatch:
        self._thread = threading.Thread(target=self._run, name="member-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._resync_s + 10)

    def sync(self) -> int:
        """List once and report the differences; returns the revision listed."""
        items, revision = self._etcd.list_prefix(self._prefix)
        current = _decode_all(items)
        for key, member in list(self._known.items()):
            if current.get(key) != member:
                del self._known[key]
                self._report(self._on_leave, member)
        for key, member in current.items():
            if key not in self._known:
                self._known[key] = member
                self._report(self._on_join, member)
        self.synced.set()
        return revision

    def _report(self, callback: Callable[[Member], None], member: Member) -> None:
        try:
            callback(member)
        except Exception:  # a faulty callback must not end the watch
            log.exception("member callback failed for %s", member)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                revision = self.sync()
                self._etcd.wait_change(self._prefix, revision + 1, self._resync_s)
            except EtcdUnavailable as exc:
                log.warning("member watch: %s", exc)
                self._stop.wait(self._resync_s)

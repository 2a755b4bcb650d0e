"""Workers joining and leaving a running cluster through etcd (`kvcake serve --etcd`).

Every worker keeps a key under `/kvcake/<cluster>/members/{prefill,decode}/<worker_id>` alive
with its lease (worker/membership.py). `EtcdWorkers` watches those keys: a worker that appears is
connected and handed to the Conductor (`DisaggBackend.add_worker`); one whose key goes (its
process died or left: the lease ended) is removed, as a lost link would be. A worker that
restarts registers again and rejoins under its id. A worker that cannot be reached at the
address it advertises (or serves another KV layout) is logged with what to fix, kept in
`refused`, and tried again when it registers again.
"""

from __future__ import annotations

import logging
import time

from kvcake.registry import Etcd, Member, MemberWatch
from kvcake.server.cluster.backend import DisaggBackend

log = logging.getLogger(__name__)

WORKER_ROLES = ("prefill", "decode")


class EtcdWorkers:
    def __init__(self, backend: DisaggBackend, etcd: Etcd, cluster: str,
                 resync_s: float = 2.0) -> None:
        self.backend = backend
        self._watches = [MemberWatch(etcd, cluster, self._join, self._leave, role=role,
                                     resync_s=resync_s) for role in WORKER_ROLES]
        self.joined: dict[str, str] = {}  # worker id -> address, as connected
        self.refused: dict[str, str] = {}  # worker id -> why it could not join

    def start(self) -> EtcdWorkers:
        for watch in self._watches:
            watch.start()
        return self

    def wait_synced(self, timeout_s: float) -> bool:
        """True once every role's first listing was handled (workers present at start joined)."""
        return all(w.synced.wait(timeout_s) for w in self._watches)

    def close(self) -> None:
        for watch in self._watches:
            watch.close()

    def _join(self, member: Member) -> None:
        try:
            hello = self.backend.add_worker(member.address)
        except ValueError as exc:
            self.refused[member.member_id] = str(exc)
            log.error("worker %s registered in etcd but cannot join: %s", member.member_id, exc)
            return
        if hello.worker_id != member.member_id:
            log.warning("worker registered as %s answers as %s", member.member_id,
                        hello.worker_id)
        self.refused.pop(member.member_id, None)
        self.joined[hello.worker_id] = member.address

    def _leave(self, member: Member) -> None:
        if self.joined.pop(member.member_id, None) is not None:
            self.backend.worker_left(member.member_id)


def start_membership(backend: DisaggBackend, etcd: str, cluster: str,
                     expected: list[str], timeout_s: float = 120.0) -> EtcdWorkers:
    """Watch `cluster`'s workers in etcd for `backend`, and wait until the workers this process
    launched (`expected` ids, which register like any other) have joined."""
    watch = EtcdWorkers(backend, Etcd(etcd), cluster).start()
    deadline = time.monotonic() + timeout_s
    while not set(expected) <= set(backend.live_worker_ids()):
        missing = sorted(set(expected) - set(backend.live_worker_ids()))
        refused = {w: watch.refused[w] for w in missing if w in watch.refused}
        if refused or time.monotonic() > deadline:
            watch.close()
            raise RuntimeError(f"workers {missing} did not join through etcd {etcd}"
                               + (f": {refused}" if refused else f" within {timeout_s:.0f} s"))
        time.sleep(0.05)
    return watch

"""The space a replica takes on its node: a DRAM range or disk bytes, its version, and its freeing.

Pure bookkeeping for `StoreIndex` (times are passed in). A DRAM range of a replica removed while
readers hold leases on it is not freed at once but when the last of those readers releases its
lease or `release_s` passes, whichever comes first: a read in flight never sees its range reused.
Freeing a disk replica queues the DROP_DISK action that only its node can carry out; dropping
a committed DRAM replica queues its revocation (`revoked`: node, offset, version), which the
master has the node carry out (layout.revoke) before it answers the request that dropped it, so
no client's remembered location serves it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcake.store.errors import InvalidRequest, NoNodes
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.objects import ActionKind, Replica, Tier, TierAction
from kvcake.store.placement import NodeInfo


@dataclass
class _Deferred:
    """A DRAM range of a removed replica, freed when its readers' leases end or are released."""

    node_id: str
    offset: int
    release_s: float
    lease_ids: set[int]


class NodeSpace:
    """The registered nodes' space. `nodes` and `actions` are the index's own dict and list
    (shared, never rebound): this class frees into the former and queues onto the latter."""

    def __init__(self, nodes: dict[str, NodeInfo], actions: list[TierAction]) -> None:
        self.nodes = nodes
        self.actions = actions
        self._deferred: list[_Deferred] = []
        self._next_version = 1
        self.revoked: list[tuple[str, int, int]] = []  # (node_id, offset, version) to revoke

    def new_version(self) -> int:
        """A version no allocation had before: a reused range never matches an old descriptor."""
        self._next_version += 1
        return self._next_version - 1

    def raise_version_floor(self, floor: int) -> None:
        """Hand out versions from `floor` on (at least): a new master starts above every
        version an earlier master gave, so a replica written for the old one never matches."""
        self._next_version = max(self._next_version, floor)

    def check_fits(self, alloc_bytes: int) -> None:
        """NoNodes without nodes; InvalidRequest if no segment could ever hold `alloc_bytes`."""
        if not self.nodes:
            raise NoNodes("no store node is registered: start `kvcake store node`")
        largest = max(n.allocator.capacity_bytes for n in self.nodes.values())
        if not any(n.allocator.aligned(alloc_bytes) <= n.allocator.capacity_bytes
                   for n in self.nodes.values()):
            raise InvalidRequest(
                f"object of {alloc_bytes - HEADER_BYTES} bytes is larger than any segment "
                f"(largest {largest} bytes, {HEADER_BYTES} of them per-object header): split it "
                "or give a node more DRAM")

    def free_range(self, key: str, replica: Replica, release_s: float = 0.0,
                   readers: frozenset[int] = frozenset()) -> None:
        """Free a replica's space now, or (DRAM, `release_s` > 0) once the leases `readers` are
        released or `release_s` passes, whichever comes first. A gone node frees nothing."""
        node = self.nodes.get(replica.node_id)
        if node is None:
            return
        if replica.tier is Tier.DRAM and replica.complete:  # readable until now: revoke it
            self.revoked.append((node.node_id, replica.offset, replica.version))
        if replica.tier is Tier.DISK:
            node.disk_used_bytes -= replica.alloc_bytes
            self.actions.append(TierAction(ActionKind.DROP_DISK, node.node_id, key,
                                           disk_version=replica.version))
        elif release_s > 0:
            self._deferred.append(_Deferred(node.node_id, replica.offset, release_s,
                                            set(readers)))
        else:
            node.allocator.free(replica.offset)

    def release(self, lease_id: int) -> None:
        """The read under `lease_id` is over: free each deferred range it was the last reader of."""
        for deferred in [d for d in self._deferred if lease_id in d.lease_ids]:
            deferred.lease_ids.discard(lease_id)
            if not deferred.lease_ids:
                self._deferred.remove(deferred)
                node = self.nodes.get(deferred.node_id)
                if node is not None:
                    node.allocator.free(deferred.offset)

    def expire(self, now_s: float) -> None:
        """Free the deferred ranges whose `release_s` has come."""
        due = [d for d in self._deferred if d.release_s <= now_s]
        self._deferred = [d for d in self._deferred if d.release_s > now_s]
        for d in due:
            if d.node_id in self.nodes:
                self.nodes[d.node_id].allocator.free(d.offset)

    def forget_node(self, node_id: str) -> None:
        """The node is gone: its deferred ranges went with it."""
        self._deferred = [d for d in self._deferred if d.node_id != node_id]

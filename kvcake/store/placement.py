"""Store nodes as the master sees them, and the strategies that order them for a new replica.

Pure bookkeeping: capacities, allocators, heartbeat times (passed in), no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvcake.store.allocator import OffsetAllocator
from kvcake.store.config import Strategy


@dataclass
class NodeInfo:
    node_id: str
    endpoint: dict[str, Any]  # how clients reach the node's segment (opaque to the master)
    allocator: OffsetAllocator
    disk_capacity_bytes: int
    last_heartbeat_s: float
    disk_used_bytes: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def disk_free_bytes(self) -> int:
        return self.disk_capacity_bytes - self.disk_used_bytes


def order_nodes(
    nodes: list[NodeInfo], strategy: Strategy, rng: random.Random, local_node: str | None
) -> list[NodeInfo]:
    """Candidate nodes for a new replica, best first."""
    by_free = sorted(nodes, key=lambda n: (-n.allocator.free_bytes, n.node_id))
    if strategy is Strategy.RANDOM:
        shuffled = sorted(nodes, key=lambda n: n.node_id)
        rng.shuffle(shuffled)
        return shuffled
    if strategy is Strategy.LOCAL_FIRST and local_node is not None:
        return [n for n in by_free if n.node_id == local_node] + [
            n for n in by_free if n.node_id != local_node
        ]
    return by_free

"""Plain data of the master's metadata: objects, their replicas, and the DRAM<->disk copies the
index asks nodes to make. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Tier(StrEnum):
    DRAM = "dram"
    DISK = "disk"


@dataclass
class Replica:
    node_id: str
    tier: Tier
    offset: int  # in the node's DRAM segment; 0 on disk
    alloc_bytes: int  # header + payload
    version: int  # unique per allocation: a reused range never matches an old descriptor
    complete: bool = False


@dataclass
class ObjectMeta:
    key: str
    size_bytes: int
    checksum: int | None  # of the payload; None until the commit brings it
    replicas: list[Replica]
    committed: bool = False
    deadline_s: float = 0.0  # uncommitted puts are reclaimed after this
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> end, one per read
    pinned: bool = False
    sealing: bool = False  # named from a slot, its writer's one-way seal commits it

    @property
    def lease_until_s(self) -> float:
        """When the last read lease ends (0.0: none was given)."""
        return max(self.leases.values(), default=0.0)

    def dram(self) -> list[Replica]:
        return [r for r in self.replicas if r.tier is Tier.DRAM and r.complete]

    def disk(self) -> list[Replica]:
        return [r for r in self.replicas if r.tier is Tier.DISK and r.complete]


class ActionKind(StrEnum):
    DEMOTE = "demote"  # copy DRAM range (offset, version) to disk as disk_version
    PROMOTE = "promote"  # copy disk disk_version into DRAM range (offset) as version
    DROP_DISK = "drop_disk"  # delete disk copy disk_version


@dataclass(frozen=True)
class TierAction:
    kind: ActionKind
    node_id: str
    key: str
    offset: int = 0
    alloc_bytes: int = 0
    version: int = 0
    disk_version: int = 0

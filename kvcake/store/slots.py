"""`SlotTable`: keyless allocations (slots) a writer holds ready for its next puts, pure.

A slot is a put_start made before its key is known: a writer holds one ready, writes the next
object of that size into it and names the key in the commit (one master round trip per put).
It is placed as put_start would place it, but only in free space (it is taken ahead of need, so
it never evicts), and is invisible to readers until it is claimed under a key
(`StoreIndex.commit_slot` / `name_slot`). An unclaimed slot is released by its writer, by its
node's departure, or after `put_timeout_s`. Times are passed in.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcake.store.config import MasterConfig
from kvcake.store.errors import InvalidRequest, NoSpace, ObjectExists, ObjectNotFound
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.objects import ObjectMeta, Tier
from kvcake.store.placement import NodeInfo
from kvcake.store.space import NodeSpace
from kvcake.store.tiering import Tiering

MAX_RESERVE = 64  # slots one reserve may ask for


class SlotTable:
    """The slots of one index. `slots` and `objects` are the index's own dicts (shared, never
    rebound): a claimed slot moves from the former into the latter."""

    def __init__(self, config: MasterConfig, slots: dict[int, ObjectMeta],
                 objects: dict[str, ObjectMeta], space: NodeSpace, tiers: Tiering) -> None:
        self.config = config
        self.slots = slots
        self.objects = objects
        self.space = space
        self.tiers = tiers

    def reserve(self, size_bytes: int, count: int, num_replicas: int,
                order: Callable[[], list[NodeInfo]], now_s: float) -> list[tuple[int, ObjectMeta]]:
        """Up to `count` slots of `size_bytes`, each on the nodes `order()` gives, best first
        (asked once per slot); (slot id, its pending meta). Fewer, maybe none, when free space
        runs out."""
        if size_bytes < 0 or num_replicas < 1 or not 1 <= count <= MAX_RESERVE:
            raise InvalidRequest(f"reserve: size_bytes >= 0, num_replicas >= 1 and 1 <= count <= "
                                 f"{MAX_RESERVE}, got {size_bytes}, {num_replicas}, {count}")
        alloc = size_bytes + HEADER_BYTES
        self.space.check_fits(alloc)
        out: list[tuple[int, ObjectMeta]] = []
        for _ in range(count):
            try:
                replicas = self.tiers.allocate_on(order(), alloc, num_replicas, now_s, evict=False)
            except NoSpace:
                break
            slot_id = replicas[0].version  # never reused
            meta = ObjectMeta("", size_bytes, None, replicas,
                              deadline_s=now_s + self.config.put_timeout_s)
            self.slots[slot_id] = meta
            out.append((slot_id, meta))
        return out

    def claim(self, key: str, slot_id: int, size_bytes: int) -> ObjectMeta:
        """Slot `slot_id` becomes the uncommitted object `key` (the caller checked the key's
        form); on any error it stays a slot."""
        slot = self.slots.get(slot_id)
        if slot is None:
            raise ObjectNotFound(f"slot {slot_id} is not reserved (timed out or released?)")
        if size_bytes != slot.size_bytes:
            raise InvalidRequest(f"size_bytes: slot {slot_id} holds {slot.size_bytes} bytes, "
                                 f"got {size_bytes}")
        if key in self.objects:
            raise ObjectExists(f"key {key!r} is already stored or being written")
        del self.slots[slot_id]
        slot.key = key
        self.objects[key] = slot
        return slot

    def release(self, slot_id: int) -> None:
        """Free a slot that will not be used (unknown ids are ignored)."""
        slot = self.slots.pop(slot_id, None)
        if slot is not None:
            for replica in slot.replicas:
                self.space.free_range("", replica)

    def release_on(self, node_id: str) -> None:
        """Release every slot with a replica on node `node_id` (it is gone)."""
        for slot_id, slot in list(self.slots.items()):
            if any(r.node_id == node_id for r in slot.replicas):
                self.release(slot_id)

    def expire(self, now_s: float) -> None:
        """Release the slots not claimed by their deadline."""
        for slot_id in [i for i, m in self.slots.items() if m.deadline_s <= now_s]:
            self.release(slot_id)

    def reserved_bytes(self, nodes: dict[str, NodeInfo]) -> int:
        """The DRAM the slots hold on `nodes` (reserved, not used: a slot holds no object)."""
        return sum(nodes[r.node_id].allocator.aligned(r.alloc_bytes)
                   for slot in self.slots.values() for r in slot.replicas
                   if r.tier is Tier.DRAM and r.node_id in nodes)

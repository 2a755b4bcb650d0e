"""Block manager: which physical KV blocks each request holds, and the local prefix cache.

Pure policy (no torch, no clock): it hands out `BlockId`s and tracks keys; the engine moves the
bytes. A block is in exactly one of three states:

  held     ref_count > 0, owned by one or more requests (shared prefix blocks have ref > 1)
  cached   ref_count == 0 but keyed: its KV is still valid and a later prompt may reuse it
  empty    ref_count == 0, no key

Free blocks (cached and empty) sit in one queue, the order in which they are reused:

  head -> [empty blocks ...][cached blocks, least recently freed first ...] <- tail

Empty blocks go to the head because reusing them destroys nothing. Cached blocks go to the
tail when freed, so the cache evicts in LRU order, and a request frees its blocks last-first,
because the tail of a prompt is less likely to be shared than its head. Reusing a cached block
evicts its key, which is reported as a REMOVED event; registering a key reports STORED. The
Conductor's prefix index consumes these events (`drain_events`).

Keys come from `kvcake.hashing.block_keys` with the engine's namespace; the manager never
hashes, it only compares keys.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvcake.types import BlockId, BlockKey


class KvEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KvEvent:
    kind: KvEventKind
    key: BlockKey


@dataclass
class _Table:
    block_ids: list[BlockId]
    num_keyed: int  # leading blocks whose keys are registered (or were already cached)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"block manager: num_blocks ({num_blocks}) and block_size "
                             f"({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(i), None) for i in range(num_blocks))
        self._ref = [0] * num_blocks
        self._key_of: dict[BlockId, BlockKey] = {}
        self._block_of: dict[BlockKey, BlockId] = {}
        self._tables: dict[str, _Table] = {}
        self._events: list[KvEvent] = []

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[BlockId]:
        """Free blocks in reuse order (head first)."""
        return list(self._free)

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref[block_id]

    def lookup(self, key: BlockKey) -> BlockId | None:
        """The block holding `key`'s KV, or None when it is not cached here."""
        return self._block_of.get(key)

    def num_cached_blocks(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of `keys` held here (no side effects)."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for key in keys:
            if key not in self._block_of:
                break
            n += 1
        return n

    def block_ids(self, request_id: str) -> list[BlockId]:
        return list(self._tables[request_id].block_ids)

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int,
                 keys: Sequence[BlockKey]) -> int | None:
        """Give `request_id` blocks for `num_tokens`, reusing cached prefix blocks.

        `keys` are the keys of the full blocks of its tokens. Returns the number of tokens
        whose KV is already present (a multiple of block_size, always < num_tokens so at least
        one token is computed and yields logits), or None, changing nothing, when too few
        blocks are free.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        num_hit = self.num_cached_blocks(keys)
        # Keep one token to compute: a fully cached prompt recomputes its last block.
        num_hit = min(num_hit, (num_tokens - 1) // self.block_size)
        hits = [self._block_of[k] for k in keys[:num_hit]]
        num_new = -(-num_tokens // self.block_size) - num_hit
        num_hits_free = sum(1 for b in hits if self._ref[b] == 0)
        if num_new + num_hits_free > len(self._free):
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        table = _Table(block_ids=hits, num_keyed=num_hit)
        table.block_ids.extend(self._take_free() for _ in range(num_new))
        self._tables[request_id] = table
        return num_hit * self.block_size

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow `request_id`'s table to hold `num_tokens`; False (nothing changed) if full."""
        table = self._tables[request_id]
        num_new = -(-num_tokens // self.block_size) - len(table.block_ids)
        if num_new > len(self._free):
            return False
        table.block_ids.extend(self._take_free() for _ in range(max(num_new, 0)))
        return True

    def cache_full_blocks(self, request_id: str, keys: Sequence[BlockKey]) -> None:
        """Register the keys of `request_id`'s computed full blocks (keys[i] names block i).

        Call after the KV of those blocks is written. A key already cached in another block
        (two requests computed the same prefix at once) is left with that block.
        """
        table = self._tables[request_id]
        if not self.enable_prefix_caching:
            return
        for i in range(table.num_keyed, min(len(keys), len(table.block_ids))):
            block, key = table.block_ids[i], keys[i]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key
                self._events.append(KvEvent(KvEventKind.STORED, key))
        table.num_keyed = max(table.num_keyed, min(len(keys), len(table.block_ids)))

    def free(self, request_id: str) -> None:
        """Release `request_id`'s blocks (last first); keyed ones stay cached until reused."""
        table = self._tables.pop(request_id)
        for b in reversed(table.block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if b not in self._key_of:
                    self._free.move_to_end(b, last=False)

    def import_block(self, key: BlockKey) -> BlockId | None:
        """Make room for a block fetched from elsewhere and key it; None if already cached here
        or no block is free. The caller writes the KV into the returned block at once; the
        block is then cached (ref 0, most recently used)."""
        if not self.enable_prefix_caching or key in self._block_of or not self._free:
            return None
        block = self._take_free()
        self._ref[block] = 0
        self._block_of[key] = block
        self._key_of[block] = key
        self._free[block] = None
        self._events.append(KvEvent(KvEventKind.STORED, key))
        return block

    def drain_events(self) -> list[KvEvent]:
        """Blocks stored and removed since the last call, in order."""
        events, self._events = self._events, []
        return events

    def _take_free(self) -> BlockId:
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            self._events.append(KvEvent(KvEventKind.REMOVED, key))
        self._ref[block] = 1
        return block

"""A cached block's KV by its block key (`kvcake.hashing.block_keys`), a part of `Engine`:
prefix matching, export and import of one block's bytes (its layers' K|V slices in layer
order), one layer of a block for layer-wise streaming, and the KV events for the Conductor's
index."""

from __future__ import annotations

from collections.abc import Sequence

from kvcake.engine.block_manager import BlockManager, KvEvent
from kvcake.engine.kv_pool import KVPool
from kvcake.hashing import block_keys
from kvcake.types import BlockId, BlockKey


class KvExchange:
    """`Engine`'s prefix-cache-by-key methods; the state below is the engine's."""

    block_size: int
    namespace: str
    pool: KVPool
    block_manager: BlockManager

    def prompt_block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        return block_keys(token_ids, self.block_size, self.namespace)

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV this instance holds now (full blocks only; no side effects)."""
        return self.block_manager.num_cached_blocks(self.prompt_block_keys(token_ids)) * \
            self.block_size

    def export_block_kv(self, key: BlockKey) -> bytes | None:
        """One cached block's KV bytes (all layers), or None when `key` is not cached here."""
        block = self.block_manager.lookup(key)
        return None if block is None else self.pool.export_block(block)

    def export_layer_kv(self, block_id: BlockId, layer_idx: int) -> bytes:
        """One layer of one block by block id (for layer-wise streaming from a layer_hook)."""
        return self.pool.export_layer(block_id, layer_idx)

    def import_block_kv(self, key: BlockKey, data: bytes) -> bool:
        """Insert a fetched block into the prefix cache; a later prompt with this key reuses it.
        False when the key is already cached or no block is free; ValueError on a wrong size."""
        if len(data) != self.pool.block_nbytes:
            raise ValueError(f"kv bytes: one block is {self.pool.block_nbytes} bytes, "
                             f"got {len(data)}")
        block = self.block_manager.import_block(key)
        if block is None:
            return False
        self.pool.import_block(block, data)
        return True

    def drain_kv_events(self) -> list[KvEvent]:
        return self.block_manager.drain_events()

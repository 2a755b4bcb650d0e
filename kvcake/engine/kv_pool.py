"""The paged KV pool: one pre-allocated tensor, layer-major.

Shape [num_layers, num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]. Layer-major means
`pool.layer(l)[b]` (one layer of one block, K and V together) is one contiguous slice of
`layer_nbytes` bytes: the unit a worker streams layer by layer, and a block's bytes are its
layers' slices concatenated in layer order (the unit the store keeps as one object).

The pool is zero-filled at start: attention over padded block tables reads blocks that were
never written, and masked zeros (unlike uninitialised memory, which may hold NaN) contribute
exactly nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcake.engine.config import ModelConfig
from kvcake.types import BlockId


class KVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = config.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kv = torch.zeros(config.num_layers, num_blocks, 2, block_size, config.num_kv_heads,
                              config.head_size, dtype=dtype, device=device)
        self.layer_shape = tuple(self.kv.shape[2:])
        self.layer_nbytes = self.kv[0, 0].numel() * self.kv.element_size()
        self.block_nbytes = self.layer_nbytes * config.num_layers

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return block_size * config.kv_bytes_per_token(itemsize)

    def layer(self, layer_idx: int) -> Tensor:
        """[num_blocks, 2, block_size, num_kv_heads, head_dim] view of one layer."""
        return self.kv[layer_idx]

    def export_layer(self, block_id: BlockId, layer_idx: int) -> bytes:
        """One layer of one block as bytes (K then V, row-major)."""
        data = self.kv[layer_idx, block_id].contiguous().cpu()
        return data.view(torch.uint8).numpy().tobytes()

    def export_block(self, block_id: BlockId) -> bytes:
        return b"".join(self.export_layer(block_id, i) for i in range(self.num_layers))

    def import_layer(self, block_id: BlockId, layer_idx: int, data: bytes) -> None:
        if len(data) != self.layer_nbytes:
            raise ValueError(f"kv bytes: one layer of one block is {self.layer_nbytes} bytes, "
                             f"got {len(data)}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype)
        self.kv[layer_idx, block_id].copy_(src.view(self.layer_shape))

    def import_block(self, block_id: BlockId, data: bytes) -> None:
        if len(data) != self.block_nbytes:
            raise ValueError(f"kv bytes: one block is {self.block_nbytes} bytes "
                             f"({self.num_layers} layers), got {len(data)}")
        n = self.layer_nbytes
        for i in range(self.num_layers):
            self.import_layer(block_id, i, data[i * n:(i + 1) * n])

    def layer_offset_bytes(self, block_id: BlockId, layer_idx: int) -> int:
        """Byte offset of layer `layer_idx` of block `block_id` from `kv.data_ptr()`: where a
        remote writer puts that layer's `layer_nbytes` (K half, then V half)."""
        if not 0 <= block_id < self.num_blocks or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"kv address: block {block_id} / layer {layer_idx} is outside the "
                             f"pool ({self.num_blocks} blocks, {self.num_layers} layers)")
        return (layer_idx * self.num_blocks + block_id) * self.layer_nbytes

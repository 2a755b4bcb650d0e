"""The paged KV pool: one pre-allocated tensor, layer-major.

Shape [num_layers, num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]. Layer-major means
`pool.layer(l)[b]` (one layer of one block, K and V together) is one contiguous slice of
`layer_nbytes` bytes: the unit a worker streams layer by layer, and a block's bytes are its
layers' slices concatenated in layer order (the unit the store keeps as one object).

The pool is zero-filled at start: attention over padded block tables reads blocks that were
never written, and masked zeros (unlike uninitialised memory, which may hold NaN) contribute
exactly nothing.

Backing memory: private to the engine by default. A caller that lets other processes write the
pool directly (a decode worker: its transfer engine serves the pool as a segment, in shared
memory so that same-host prefill workers write it by memcpy) passes `memory`, a writable CPU
byte buffer of exactly `nbytes(...)` bytes; `kv` is then a tensor view of that buffer (no copy),
which keeps the buffer alive, and whoever allocated it decides when its name goes away.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvcake.engine.config import ModelConfig
from kvcake.types import BlockId

KvAllocator = Callable[[int], Any]
"""`allocate(nbytes) -> memory`: the backing buffer of a `KVPool` of `nbytes` bytes (a writable,
contiguous CPU buffer of exactly that length: mmap, memoryview, bytearray, numpy array). Called
once, by the engine, after it sized its pool."""


class KVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, *, memory: Any | None = None) -> None:
        """ValueError when `memory` is given for a non-CPU device, or is not a writable buffer
        of exactly `nbytes(config, num_blocks, block_size, dtype)` bytes."""
        self.num_layers = config.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads,
                 config.head_size)
        if memory is None:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.kv = _view_of(memory, shape, dtype, device)
            self.kv.zero_()  # the invariant above, whatever the allocator handed over
        # One view per layer, made once (indexing `kv` per layer per step showed in a step).
        self.layer_views: tuple[Tensor, ...] = tuple(self.kv.unbind(0))
        # The same layers as rows [num_blocks * 2 * block_size, num_kv_heads, head_dim] (where
        # a step writes each token's K and V), also made once.
        self.layer_rows: tuple[Tensor, ...] = tuple(v.view(-1, *v.shape[-2:])
                                                    for v in self.layer_views)
        self.layer_shape = tuple(self.kv.shape[2:])
        self.layer_nbytes = self.kv[0, 0].numel() * self.kv.element_size()
        self.block_nbytes = self.layer_nbytes * config.num_layers

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return block_size * config.kv_bytes_per_token(itemsize)

    @staticmethod
    def nbytes(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
        """Size of the whole pool: what a `KvAllocator` is asked for."""
        return num_blocks * KVPool.bytes_per_block(config, block_size, dtype)

    def layer(self, layer_idx: int) -> Tensor:
        """[num_blocks, 2, block_size, num_kv_heads, head_dim] view of one layer."""
        return self.layer_views[layer_idx]

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


def _view_of(memory: Any, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> Tensor:
    """`memory` as a tensor of `shape` and `dtype`, sharing its bytes."""
    if device.type != "cpu":
        raise ValueError(f"kv pool memory: a backing buffer is host memory, but the engine runs "
                         f"on {device}; use device cpu, or no KV allocator")
    try:
        view = memoryview(memory)
    except TypeError:
        raise ValueError(f"kv pool memory: {type(memory).__name__} is not a buffer; pass mmap, "
                         f"memoryview, bytearray or a numpy array") from None
    if view.readonly or not view.c_contiguous:
        raise ValueError("kv pool memory: the buffer must be writable and contiguous")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if view.nbytes != expected:
        raise ValueError(f"kv pool memory: the pool needs exactly {expected} bytes, the buffer "
                         f"holds {view.nbytes}; allocate KVPool.nbytes(...) bytes")
    flat = torch.frombuffer(view if view.format == "B" and view.ndim == 1 else view.cast("B"),
                           dtype=torch.uint8)
    return flat.view(dtype).view(shape)

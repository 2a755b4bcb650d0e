"""The KV pool over caller-provided memory (a decode worker's shared-memory segment): a view, not
a copy, zero-filled, with the layout remote writers address; and the engine's allocator hook."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from kvcake import LLM, SamplingParams
from kvcake.engine.config import PRESETS
from kvcake.engine.engine import Engine
from kvcake.engine.kv_pool import KVPool
from kvcake.types import BlockId

from .conftest import SMALL_POOL

TINY = PRESETS["tiny"]
CPU = torch.device("cpu")


def test_the_pool_is_a_zeroed_view_of_the_memory_it_was_given() -> None:
    nbytes = KVPool.nbytes(TINY, 3, 16, torch.float32)
    assert nbytes == 3 * KVPool.bytes_per_block(TINY, 16, torch.float32)
    memory = mmap.mmap(-1, nbytes)
    memory.write(b"\x7f" * nbytes)  # whatever was there: the pool starts at zero regardless
    pool = KVPool(TINY, 3, 16, torch.float32, CPU, memory=memory)
    raw = np.frombuffer(memory, dtype=np.uint8)
    assert pool.kv.data_ptr() == raw.ctypes.data
    assert pool.kv.shape == (TINY.num_layers, 3, 2, 16, TINY.num_kv_heads, TINY.head_size)
    assert not raw.any()
    # A remote writer puts layer 1 of block 2 at layer_offset_bytes: the engine sees it there.
    at, n = pool.layer_offset_bytes(BlockId(2), 1), pool.layer_nbytes
    raw[at:at + n] = np.frombuffer(np.full(n // 4, 1.5, np.float32).tobytes(), np.uint8)
    assert bool((pool.kv[1, 2] == 1.5).all())
    assert float(pool.kv.sum()) == 1.5 * (n // 4)
    # ... and what the engine writes is in the memory, where a peer reads it.
    pool.kv[0, 0, 1, 0, 0, 0] = 2.0
    offset = pool.layer_offset_bytes(BlockId(0), 0) + pool.layer_nbytes // 2  # V half
    assert raw[offset:offset + 4].view(np.float32)[0] == 2.0


def test_bad_backing_memory_is_refused_naming_what_to_change() -> None:
    nbytes = KVPool.nbytes(TINY, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=rf"needs exactly {nbytes} bytes, the buffer holds "
                                         rf"{nbytes + 1}; allocate KVPool.nbytes"):
        KVPool(TINY, 2, 16, torch.float32, CPU, memory=bytearray(nbytes + 1))
    with pytest.raises(ValueError, match="must be writable"):
        KVPool(TINY, 2, 16, torch.float32, CPU, memory=bytes(nbytes))
    with pytest.raises(ValueError, match="int is not a buffer"):
        KVPool(TINY, 2, 16, torch.float32, CPU, memory=nbytes)
    with pytest.raises(ValueError, match="engine runs on cuda; use device cpu"):
        KVPool(TINY, 2, 16, torch.float32, torch.device("cuda"), memory=bytearray(nbytes))


def test_an_engine_over_allocated_memory_generates_what_the_offline_llm_does() -> None:
    asked: list[int] = []
    blocks: list[mmap.mmap] = []

    def allocate(nbytes: int) -> mmap.mmap:
        asked.append(nbytes)
        blocks.append(mmap.mmap(-1, nbytes))
        return blocks[-1]

    engine = Engine("tiny", SMALL_POOL, kv_allocator=allocate)
    assert asked == [KVPool.nbytes(TINY, engine.num_blocks, 16, torch.float32)]
    assert engine.pool.kv.data_ptr() == np.frombuffer(blocks[0], np.uint8).ctypes.data
    prompt = list(range(3, 43))
    engine.add_request("r", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
    offline = LLM("tiny", config=SMALL_POOL).generate(
        [prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    assert tokens == offline[0].token_ids
    assert np.frombuffer(blocks[0], np.uint8).any()  # the KV went into the given memory

"""`read_blocks`: a prefix's KV blocks read from the store into fresh buffers, on a fetcher
thread (the prefill worker's and a CPP stage's), keyed `namespace:key_hex` as `StoreWriter`
writes them. A failed read is logged and reads as nothing stored: the caller recomputes."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvcake.hashing import key_hex
from kvcake.store import StoreClient, StoreError
from kvcake.transfer import TransferError
from kvcake.types import BlockKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlocksRead:
    """What was read: each block's size (None: not in the store), its buffer, the wall time."""

    sizes: list[int | None]
    buffers: list[bytearray]
    seconds: float


def read_blocks(store: StoreClient, namespace: str, keys: list[int], block_nbytes: int,
                reader: str) -> BlocksRead:
    """Read `keys` (whole blocks of `block_nbytes`) in one batch; `reader` names the worker in
    the warning a failed read logs."""
    buffers = [bytearray(block_nbytes) for _ in keys]
    start = time.perf_counter()
    try:
        sizes = store.get_batch_into([f"{namespace}:{key_hex(BlockKey(k))}" for k in keys],
                                     buffers)
    except (StoreError, TransferError, OSError, ValueError) as exc:
        log.warning("%s: fetch of %d blocks failed, recomputing: %s", reader, len(keys), exc)
        sizes = [None] * len(keys)
    return BlocksRead(sizes, buffers, time.perf_counter() - start)

"""`StageStoreWriter`: a CPP stage's layers of a prompt's full KV blocks into the store, off the
engine thread.

A stage holds only its slice of the layers, so it stores each block's slice as its own object
(`namespace:key_hex@lo-hi`, block_fetch.range_key) and reports it with its layers
(`StoreEvents(keys, layers=[lo, hi])`). The frontend lists a block as stored (holder "store")
only once the slices of every layer have been reported (cluster/stage_stores.py): a block is
never visible in part. Every prompt a group prefills is stored this way, as a plain prefill
worker's is (global_cache), whether or not a decode worker ever takes the request.

`write_prompt` (engine-loop thread, while the request's blocks are still allocated) copies the
stage's layers of the full blocks from `first_block` on out of its pool in one gather; the
writer thread puts them and reports them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvcake.engine.stage import StageEngine
from kvcake.hashing import block_keys
from kvcake.server.worker.block_fetch import range_key
from kvcake.server.worker.messages import StoreEvents
from kvcake.server.worker.recent_keys import RecentKeys
from kvcake.server.worker.role import RoleHost
from kvcake.store import StoreError
from kvcake.transfer import TransferError

log = logging.getLogger(__name__)

_Write = tuple[list[int], np.ndarray]  # block keys, their slices [blocks, slice bytes]


class StageStoreWriter:
    def __init__(self, worker: RoleHost, stage: StageEngine) -> None:
        self.worker = worker
        self.stage = stage
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._put_keys = RecentKeys()  # keys handed to the writer
        self._thread: threading.Thread | None = None
        self.num_stored = 0  # slices stored (tests, inspection)

    def start(self) -> None:
        """Start the writer thread (nothing to do without a store)."""
        if self.worker.store is not None:
            self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                            name=f"{self.worker.worker_id}-stage-store")
            self._thread.start()

    def close(self) -> None:
        """Stop after the queued writes."""
        if self._thread is not None:
            self._writes.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def write_prompt(self, request_id: str, prompt: Sequence[int], first_block: int) -> int:
        """Queue this stage's layers of the prompt's full blocks from `first_block` on (those
        before it are the prefix reused from the store); returns the blocks queued. Call on the
        engine-loop thread before the request's blocks are freed."""
        if self._thread is None:
            return 0
        stage = self.stage
        bs = stage.block_size
        keys = block_keys(list(prompt[:len(prompt) // bs * bs]), bs, stage.namespace)
        ids = stage.block_ids(request_id)
        picked = [(int(k), ids[b]) for b, k in enumerate(keys)
                  if b >= first_block and int(k) not in self._put_keys]
        if not picked:
            return 0
        self._put_keys.add(k for k, _ in picked)
        index = torch.tensor([i for _, i in picked], dtype=torch.long)
        # [layers, blocks, ...] -> [blocks, layers, ...]: each block's slice in layer order
        data = stage.pool.kv.index_select(1, index).transpose(0, 1).contiguous()
        self._writes.put(([k for k, _ in picked],
                          data.view(torch.uint8).reshape(len(picked), -1).numpy()))
        return len(picked)

    def _write_loop(self) -> None:
        store = self.worker.store
        assert store is not None
        ns, layers = self.stage.namespace, self.stage.layers
        while (item := self._writes.get()) is not None:
            keys, data = item
            try:
                store.put_batch([range_key(ns, k, layers) for k in keys], list(data))
            except (StoreError, TransferError, OSError) as exc:
                log.warning("%s: store write of %d block slices failed: %s",
                            self.worker.worker_id, len(keys), exc)
                self._put_keys.forget(keys)
                continue
            self.num_stored += len(keys)
            # Written now, or already there (put returns False): either way the store has them.
            self.worker.send(StoreEvents(keys, [layers.start, layers.stop]))

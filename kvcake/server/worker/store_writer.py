"""`StoreWriter`: a prompt's full KV blocks into the store, off the engine thread.

`write_prompt` (engine-loop thread) copies out the prompt's full blocks that this engine caches
and has not handed over before; the writer thread puts them (`namespace:key_hex`, async
two-phase puts by the store client) and reports them to the frontend (`StoreEvents`: holder
"store" in the Conductor), so later prompts anywhere reuse them. A prefill worker writes what
it computed; a decode worker writes a prompt when its `DecodeOrder` asks (`store_prompt`; a CPP
group's stages store their own layers instead: stage_store.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from kvcake.server.worker.block_fetch import block_key
from kvcake.server.worker.messages import StoreEvents
from kvcake.server.worker.recent_keys import RecentKeys
from kvcake.server.worker.role import RoleHost
from kvcake.store import StoreError
from kvcake.transfer import TransferError
from kvcake.types import BlockKey

if TYPE_CHECKING:
    from kvcake.engine.engine import Engine

log = logging.getLogger(__name__)


class StoreWriter:
    def __init__(self, worker: RoleHost, engine: Engine) -> None:
        self.worker = worker
        self.engine = engine
        self._writes: queue.Queue[tuple[list[BlockKey], list[bytes]] | None] = queue.Queue()
        self._put_keys = RecentKeys()  # keys handed to the writer
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the writer thread (nothing to do without a store)."""
        if self.worker.store is not None:
            self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                            name=f"{self.worker.worker_id}-store-writer")
            self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._writes.put(None)
            self._thread.join(timeout=10)

    def write_prompt(self, prompt: list[int]) -> None:
        """Queue the prompt's full blocks this engine caches (engine-loop thread)."""
        if self._thread is None:
            return
        keys, blobs = [], []
        for key in self.engine.prompt_block_keys(prompt):
            if int(key) in self._put_keys:
                continue
            data = self.engine.export_block_kv(key)
            if data is None:
                break
            keys.append(key)
            blobs.append(data)
        self._put_keys.add(int(k) for k in keys)
        if keys:
            self._writes.put((keys, blobs))

    def _write_loop(self) -> None:
        store = self.worker.store
        assert store is not None
        ns = self.engine.namespace
        while True:
            item = self._writes.get()
            if item is None:
                return
            keys, blobs = item
            try:
                store.put_batch([block_key(ns, k) for k in keys], blobs)
            except (StoreError, TransferError, OSError) as exc:
                log.warning("%s: store write of %d blocks failed: %s", self.worker.worker_id,
                            len(keys), exc)
                self._put_keys.forget(int(k) for k in keys)
                continue
            # Written now, or already there (put returns False): either way the store has them.
            self.worker.send(StoreEvents([int(k) for k in keys]))

"""Disaggregation's hand-off of a request's KV between engines, a part of `Engine`.

Prefill side: a finished prefill-only request keeps its blocks (and its seeded sampler state)
until `release`; `sampler_state` exports the state for the decode engine.
Decode side: `add_request_with_kv` admits a request whose prompt KV came as bytes (a staging
copy); the copy-free way is `reserve_request` (blocks for a remote writer), then
`commit_reserved` (join continuous batching) or `cancel_reserved`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvcake.clock import Clock
from kvcake.engine.batcher import Batcher
from kvcake.engine.block_manager import BlockManager
from kvcake.engine.config import ModelConfig
from kvcake.engine.kv_pool import KVPool
from kvcake.engine.sampling import Sampler, SamplingParams
from kvcake.engine.sequence import Sequence as Seq
from kvcake.types import BlockId, RequestId


class KvHandoff:
    """`Engine`'s hand-off methods; the state below is the engine's (set by `Engine`)."""

    clock: Clock
    model_config: ModelConfig
    device: torch.device
    block_size: int
    namespace: str
    pool: KVPool
    block_manager: BlockManager
    batcher: Batcher
    sampler: Sampler
    _seqs: dict[str, Seq]
    _params: dict[str, SamplingParams]
    _held: dict[str, Seq]  # finished prefill-only requests still holding blocks
    _held_sampler_state: dict[str, bytes]  # their seeded generators, for export
    _reserved: dict[str, tuple[Seq, SamplingParams]]  # blocks awaiting remote KV

    if TYPE_CHECKING:
        def _validate(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams) -> list[int]: ...

    def add_request_with_kv(self, request_id: str, prompt_token_ids: Sequence[int],
                            first_token_id: int, kv_blocks: Sequence[bytes],
                            sampling_params: SamplingParams | None = None, *,
                            sampler_state: bytes | None = None) -> bool:
        """Admit a request whose prompt KV was computed elsewhere (decode role).

        `kv_blocks[i]` holds block i of the prompt (ceil(len(prompt) / block_size) blocks, each
        `pool.block_nbytes`). Blocks already in the local prefix cache are reused, not written.
        `sampler_state` is the prefill engine's `sampler_state(request_id)` of a seeded request,
        so its tokens equal a colocated run's. Returns False, changing nothing, when the pool
        has no room now (retry later). A staging-copy path: `reserve_request` avoids the copy.
        """
        params = sampling_params or SamplingParams()
        num_blocks = -(-len(prompt_token_ids) // self.block_size)
        if len(kv_blocks) != num_blocks:
            raise ValueError(f"kv_blocks: the prompt needs {num_blocks} blocks, "
                             f"got {len(kv_blocks)}")
        if any(len(b) != self.pool.block_nbytes for b in kv_blocks):
            raise ValueError(f"kv_blocks: each block must be {self.pool.block_nbytes} bytes")
        to_fill = self.reserve_request(request_id, prompt_token_ids, params)
        if to_fill is None:
            return False
        try:
            for block, data in zip(to_fill, kv_blocks[num_blocks - len(to_fill):], strict=True):
                self.pool.import_block(block, data)
            self.commit_reserved(request_id, first_token_id, sampler_state)
        except ValueError:
            self.cancel_reserved(request_id)
            raise
        return True

    # -- decode-side reservation (direct KV writes) ------------------------------------------
    def reserve_request(self, request_id: str, prompt_token_ids: Sequence[int],
                        sampling_params: SamplingParams | None = None) -> list[BlockId] | None:
        """Allocate the KV blocks of a request whose prompt is prefilled elsewhere, so a remote
        writer can put the KV straight into this pool (no staging copy).

        Contract. The prompt needs P = ceil(len(prompt) / block_size) blocks. Leading full
        blocks already in the local prefix cache are reused (pinned, never written); the
        returned list holds the block ids of prompt blocks P - len(result) .. P - 1, in order,
        which the caller must fill completely (the tail of a partial last block is ignored).
        Pool layout (`KVPool`): one contiguous tensor [layers, num_blocks, 2 (K, V), block_size,
        num_kv_heads, head_dim] of `pool.dtype`; layer l of block b is the `pool.layer_nbytes`
        bytes at byte offset `pool.layer_offset_bytes(b, l)` = (l * num_blocks + b) *
        layer_nbytes from `pool.kv.data_ptr()`, K in its first half and V in the second, each
        [block_size, num_kv_heads, head_dim] row-major (the bytes `export_layer_kv` returns).
        Then `commit_reserved` joins the request to batching; `cancel_reserved` (or `abort`)
        frees exactly the reserved blocks and drops the request. Until commit nothing is
        keyed, so a half-written block is never served from the prefix cache; the caller must
        stop writing before it cancels. None, changing nothing, when the pool has no room now.
        ValueError (nothing changed) on bad input, as `add_request`; max_tokens must be >= 2.
        """
        params = sampling_params or SamplingParams()
        ids = self._validate(request_id, prompt_token_ids, params)
        if params.max_tokens < 2:
            raise ValueError("max_tokens: must be >= 2 for a request whose first token is "
                             "generated elsewhere")
        seq = Seq(RequestId(request_id), ids, len(ids), params.max_tokens, self.block_size,
                  self.namespace, arrival_s=self.clock.now_s())
        # Room for the first token too, so commit never fails for want of a block.
        cached = self.block_manager.allocate(request_id, len(ids) + 1,
                                             seq.block_keys[:len(ids) // self.block_size])
        if cached is None:
            return None
        seq.num_computed_tokens = len(ids)
        seq.num_cached_tokens = cached
        self._reserved[request_id] = (seq, params)
        table = self.block_manager.block_ids(request_id)
        return table[cached // self.block_size:-(-len(ids) // self.block_size)]

    def commit_reserved(self, request_id: str, first_token_id: int,
                        sampler_state: bytes | None = None) -> None:
        """The reserved blocks are filled: register their keys in the prefix cache and join
        the request to continuous batching (it decodes from the next step()). ValueError,
        the reservation kept, for an unknown id, a first token outside the vocabulary or a
        bad `sampler_state` (see `sampler_state`)."""
        if request_id not in self._reserved:
            raise ValueError(f"request_id: {request_id!r} has no reservation; call "
                             f"reserve_request first")
        seq, params = self._reserved[request_id]
        vocab = self.model_config.vocab_size
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, int) \
                or not 0 <= first_token_id < vocab:
            raise ValueError(f"first_token_id: {first_token_id!r} is outside the vocabulary "
                             f"[0, {vocab})")
        if sampler_state is not None:
            self.sampler.import_state(request_id, params, sampler_state, self.device)
        del self._reserved[request_id]
        seq.token_ids.append(first_token_id)
        seq.update_block_keys()
        seq.first_token_s = seq.arrival_s
        self.block_manager.cache_full_blocks(
            request_id, seq.block_keys[:seq.num_prompt_tokens // self.block_size])
        self._seqs[request_id] = seq
        self._params[request_id] = params
        # A first token that ends the request (a stop id, EOS) is the prefill side's to
        # report; it should never be committed here (the prefill engine finishes with STOP).
        self.batcher.add_running(seq)

    def cancel_reserved(self, request_id: str) -> None:
        """Drop a reservation and free its blocks (reused cached prefix blocks stay cached);
        unknown ids are ignored, so a racing cancel is harmless."""
        if self._reserved.pop(request_id, None) is not None:
            self.block_manager.free(request_id)
            self.sampler.forget(request_id)

    def sampler_state(self, request_id: str) -> bytes | None:
        """A request's sampler state (its seeded generator), for `add_request_with_kv` /
        `commit_reserved` on another engine: export it after the prefill-only request's first
        token, before `release`. None for unseeded or greedy requests (nothing to carry)."""
        if request_id in self._held_sampler_state:
            return self._held_sampler_state[request_id]
        return self.sampler.export_state(request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept (no-op if none)."""
        if self._held.pop(request_id, None) is not None:
            self.block_manager.free(request_id)
            self._held_sampler_state.pop(request_id, None)

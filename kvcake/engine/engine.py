"""One engine instance: the model, its paged KV pool, prefix cache and continuous batching.

Contract for the worker loop (issue 5) and for `LLM`. The engine is single-threaded: one caller
drives it; nothing here starts a thread or a process.

Request lifecycle (colocated):
  add_request -> WAITING -> (admitted by step(): blocks allocated, cached prefix reused) ->
  RUNNING (prefill in chunks, then one token per step) -> FINISHED (stop token, EOS,
  max_tokens, or abort) -> blocks freed; full blocks stay in the prefix cache.

Prefill role (disaggregation): `add_request(..., prefill_only=True)` stops after the first token
(finish reason PREFILL_DONE) and keeps its blocks; `request_block_ids` lists them and
`step(layer_hook=...)` calls `layer_hook(layer_idx)` after each layer's KV is written during the
forward, so a worker can stream a layer of the request's blocks (`export_layer_kv`) while later
layers compute. `release(request_id)` frees the blocks once the decode side has them.

Decode role: `add_request_with_kv` admits a request whose prompt KV (and first token) came from
elsewhere (a staging copy of the bytes); it joins continuous batching at the next step(). The
copy-free way: `reserve_request` allocates the blocks (cached prefix reused) and says which a
remote writer must fill (`KVPool.layer_offset_bytes` gives each layer's address), then
`commit_reserved` joins the request to batching, or `cancel_reserved` frees the blocks.
Seeded sampling across instances: `sampler_state(rid)` on the prefill side after the first
token, passed as `sampler_state=` to `add_request_with_kv` / `commit_reserved`.

Prefix cache by block key (keys = `kvcake.hashing.block_keys(ids, block_size, namespace)`):
`num_cached_tokens`, `export_block_kv` / `import_block_kv` (one block's bytes: its layers'
K|V slices in layer order), and `drain_kv_events` (blocks stored / removed, for the
Conductor's index).

Errors: bad user input raises ValueError naming the field and leaves the engine unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvcake.clock import Clock, SystemClock
from kvcake.engine import cpu_ops, heap
from kvcake.engine.batcher import Batcher, BatchPlan, ScheduledChunk
from kvcake.engine.block_manager import BlockManager, KvEvent
from kvcake.engine.config import EngineConfig, ModelConfig
from kvcake.engine.kv_pool import KvAllocator, KVPool
from kvcake.engine.linear import BUCKET_NAMES, Linear, table_path, tune
from kvcake.engine.loader import ModelSource, load_weights, resolve
from kvcake.engine.model import LlamaModel
from kvcake.engine.runner import ModelRunner
from kvcake.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    suppress_tokens,
    token_logprob,
    token_logprobs,
)
from kvcake.engine.sequence import FinishReason
from kvcake.engine.sequence import Sequence as Seq
from kvcake.engine.tokenizer import Tokenizer
from kvcake.hashing import block_keys
from kvcake.types import BlockId, BlockKey, RequestId

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RequestOutput:
    """What one step() produced for one request (only requests that sampled, or aborted)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None  # None while running
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    arrival_s: float
    first_token_s: float | None  # clock time of the first token; None before it
    logprobs: list[TokenLogprob] | None = None  # per new token, when the request asks
    # With the first token of a request whose params ask for prompt_logprobs: one per prompt
    # token, None for the first (nothing predicts it); None otherwise.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Engine:
    def __init__(self, model: str = "tiny", config: EngineConfig | None = None,
                 clock: Clock | None = None, *, kv_allocator: KvAllocator | None = None) -> None:
        """Load `model` (a preset name or a Hugging Face directory) and allocate the KV pool.

        `kv_allocator`: where the pool's memory comes from (see `KVPool`; e.g. a transfer
        engine's shared-memory segment, so that peers write the pool directly); None: private
        memory. It is called once, with the pool's size, and only for a CPU engine.
        Raises ValueError for an unknown preset, a cost-model-only preset or a bad directory,
        and for a `kv_allocator` on a non-CPU device.
        """
        self.config = config or EngineConfig()
        self.clock = clock or SystemClock()
        source = resolve(model)
        self.model_config: ModelConfig = source.config
        self.tokenizer: Tokenizer | None = source.tokenizer
        self.device = _pick_device(self.config.device)
        if self.device.type == "cpu":
            heap.keep_freed_memory()  # a step's activations: no page faults on the next step
        self.dtype = _DTYPES[self.config.dtype]
        self.block_size = self.config.block_size
        mc = self.model_config
        self.max_model_len = max_model_len_of(mc, self.config)
        self.namespace = kv_namespace(mc, self.config, from_directory=source.directory is not None)
        self.model = load_model(model, source, self.config)
        if kv_allocator is not None and self.device.type != "cpu":
            raise ValueError(f"kv_allocator: the KV pool of an engine on {self.device} lives in "
                             f"device memory; use device cpu, or no allocator")
        self.model.to(device=self.device, dtype=self.dtype).eval()
        num_blocks = self.config.num_blocks or max(
            1, self.config.kv_cache_bytes // KVPool.bytes_per_block(mc, self.block_size, self.dtype))
        memory = None if kv_allocator is None else \
            kv_allocator(KVPool.nbytes(mc, num_blocks, self.block_size, self.dtype))
        self.pool = KVPool(mc, num_blocks, self.block_size, self.dtype, self.device,
                           memory=memory)
        self.block_manager = BlockManager(num_blocks, self.block_size,
                                          self.config.enable_prefix_caching)
        self.batcher = Batcher(self.block_manager, self.config.max_num_batched_tokens,
                               self.config.max_num_seqs)
        self.linear_choices = tune(
            _linears(self.model), self.config.linear_backend,
            table=table_path(cpu_ops.cache_dir(), torch.get_num_threads()))
        self.attention = self._attention_mode()
        log.info("engine: decode attention %s; linear backends (rows %s) %s",
                 self.attention, BUCKET_NAMES, {f"{c.shape[0]}x{c.shape[1]}": "|".join(c.backends)
                                  for c in self.linear_choices})
        self.runner = ModelRunner(self.model, self.pool, self.device,
                                  paged_attention=self.attention == "kernel")
        self.sampler = Sampler()
        self._seqs: dict[str, Seq] = {}
        self._params: dict[str, SamplingParams] = {}
        self._held: dict[str, Seq] = {}  # finished prefill-only requests still holding blocks
        self._held_sampler_state: dict[str, bytes] = {}  # their seeded generators, for export
        self._reserved: dict[str, tuple[Seq, SamplingParams]] = {}  # blocks awaiting remote KV
        # Prompt log probabilities so far (token 1 on) of requests that ask, until reported.
        self._prompt_lp: dict[str, list[TokenLogprob]] = {}

    def _attention_mode(self) -> str:
        """"kernel" (paged-attention op) or "gather", from the config and what loads."""
        mode = self.config.attention
        if mode == "gather" or self.device.type != "cpu":
            return "gather"
        if cpu_ops.load():
            return "kernel"
        if mode == "kernel":
            raise ValueError(f"attention: the paged-attention op could not be built "
                             f"({cpu_ops.load_error()}); use attention 'auto' or "
                             f"'gather', or install a C++ compiler")
        return "gather"

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *,
                    prefill_only: bool = False, arrival_s: float | None = None) -> None:
        """Queue a request; it is admitted by a later step(). ValueError on bad input."""
        params = sampling_params or SamplingParams()
        ids = self._validate(request_id, prompt_token_ids, params)
        seq = Seq(RequestId(request_id), ids, len(ids), params.max_tokens, self.block_size,
                  self.namespace, prefill_only=prefill_only,
                  arrival_s=self.clock.now_s() if arrival_s is None else arrival_s)
        if params.prompt_logprobs is not None:
            seq.reuse_prefix = False  # a cached prefix has no logits: compute the whole prompt
            self._prompt_lp[request_id] = []
        self._seqs[request_id] = seq
        self._params[request_id] = params
        self.batcher.add(seq)

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

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks. Unknown or finished ids are ignored, so a racing
        abort is harmless."""
        if request_id in self._held:
            self.release(request_id)
            return
        if request_id in self._reserved:
            self.cancel_reserved(request_id)
            return
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = FinishReason.ABORT
            self.batcher.finish(seq)
            self._params.pop(request_id, None)
            self._prompt_lp.pop(request_id, None)
            self.sampler.forget(request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept (no-op if none)."""
        if self._held.pop(request_id, None) is not None:
            self.block_manager.free(request_id)
            self._held_sampler_state.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.batcher.has_unfinished()

    def request_block_ids(self, request_id: str) -> list[BlockId]:
        """Blocks a request holds (after admission), in token order."""
        return self.block_manager.block_ids(request_id)

    # -- the loop ----------------------------------------------------------------------------
    def step(self, layer_hook: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report every request that got a token."""
        plan = self.batcher.schedule()
        if not plan.chunks:
            return []
        tables = {c.request_id: self.block_manager.block_ids(c.request_id) for c in plan.chunks}
        prompt_rows = {c.request_id: self._seqs[c.request_id].num_prompt_tokens - 1
                       for c in plan.chunks if c.request_id in self._prompt_lp}
        logits = self.runner.run(plan, self._seqs, tables, layer_hook,
                                 prompt_rows=prompt_rows or None)
        sampling = [c.request_id for c in plan.chunks if c.samples]
        if prompt_rows:
            self._collect_prompt_logprobs(plan, prompt_rows, logits[len(sampling):])
            logits = logits[:len(sampling)]
        self._suppress_early_stops(logits, sampling)
        self._penalize(logits, sampling)
        new_ids = self.sampler.sample(logits, sampling, [self._params[r] for r in sampling])
        sampled = dict(zip(sampling, new_ids, strict=True))
        logprobs = {rid: token_logprob(logits[row], new_ids[row], top)
                    for row, rid in enumerate(sampling)
                    if (top := self._params[rid].logprobs) is not None}
        now_s = self.clock.now_s()
        outputs: list[RequestOutput] = []
        for chunk in plan.chunks:
            seq = self._seqs[chunk.request_id]
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                self._append_token(seq, sampled[chunk.request_id], now_s)
            seq.update_block_keys()
            self.block_manager.cache_full_blocks(
                seq.request_id, seq.block_keys[:seq.num_computed_tokens // self.block_size])
            if chunk.samples:
                lp = logprobs.get(chunk.request_id)
                prompt_lp = self._prompt_lp.pop(chunk.request_id, None)
                outputs.append(self._output(
                    seq, [sampled[chunk.request_id]], None if lp is None else [lp],
                    None if prompt_lp is None else [None, *prompt_lp]))
                if seq.finish_reason is not None:
                    self._finish(seq)
        return outputs

    def _collect_prompt_logprobs(self, plan: BatchPlan, prompt_rows: dict[str, int],
                                 rows: torch.Tensor) -> None:
        """Prompt log probabilities from the runner's extra rows (`prompt_rows` order): the
        logits at position p score prompt token p + 1. A recomputed chunk (after preemption)
        replaces what its positions had."""
        offset = 0
        for chunk in plan.chunks:
            end = prompt_rows.get(chunk.request_id)
            if end is None:
                continue
            count = max(0, min(chunk.start + chunk.num_tokens, end) - chunk.start)
            seq = self._seqs[chunk.request_id]
            found = self._prompt_lp[chunk.request_id]
            del found[chunk.start:]
            targets = seq.token_ids[chunk.start + 1:chunk.start + 1 + count]
            found.extend(token_logprobs(rows[offset:offset + count], targets,
                                        self._params[chunk.request_id].prompt_logprobs or 0))
            offset += count

    def _suppress_early_stops(self, logits: torch.Tensor, sampling: list[str]) -> None:
        """min_tokens: mask the stop ids (and EOS unless ignore_eos) of rows still short."""
        rows: list[int] = []
        banned: list[tuple[int, ...]] = []
        for row, rid in enumerate(sampling):
            params = self._params[rid]
            if self._seqs[rid].num_output_tokens < params.min_tokens:
                rows.append(row)
                eos = () if params.ignore_eos else self.eos_token_ids
                banned.append(params.stop_token_ids + eos)
        if rows:
            with torch.inference_mode():  # the logits are an inference-mode tensor
                suppress_tokens(logits, rows, banned)

    def _penalize(self, logits: torch.Tensor, sampling: list[str]) -> None:
        """Repetition / frequency / presence penalties of the rows that ask for them."""
        for row, rid in enumerate(sampling):
            params = self._params[rid]
            if params.penalized:
                seq = self._seqs[rid]
                with torch.inference_mode():
                    apply_penalties(logits, row, seq.token_ids[:seq.num_prompt_tokens],
                                    seq.output_token_ids, params)

    def _append_token(self, seq: Seq, token_id: int, now_s: float) -> None:
        seq.token_ids.append(token_id)
        if seq.first_token_s is None:
            seq.first_token_s = now_s
        self._append_stop_check(seq)

    def _append_stop_check(self, seq: Seq) -> None:
        """Set `finish_reason` if the last token ends `seq`."""
        params = self._params[seq.request_id]
        token_id = seq.token_ids[-1]
        if token_id in params.stop_token_ids or (
                not params.ignore_eos and token_id in self.eos_token_ids):
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        elif seq.prefill_only:
            seq.finish_reason = FinishReason.PREFILL_DONE

    def _finish(self, seq: Seq) -> None:
        keep = seq.prefill_only
        self.batcher.finish(seq, keep_blocks=keep)
        if keep:
            self._held[seq.request_id] = seq
            state = self.sampler.export_state(seq.request_id)
            if state is not None:
                self._held_sampler_state[seq.request_id] = state
        del self._seqs[seq.request_id]
        del self._params[seq.request_id]
        self._prompt_lp.pop(seq.request_id, None)
        self.sampler.forget(seq.request_id)

    def _output(self, seq: Seq, new_ids: list[int],
                logprobs: list[TokenLogprob] | None = None,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
        return RequestOutput(logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            request_id=seq.request_id, new_token_ids=new_ids,
            finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens or 0,
            arrival_s=seq.arrival_s, first_token_s=seq.first_token_s)

    def _validate(self, request_id: str, prompt_token_ids: Sequence[int],
                  params: SamplingParams) -> list[int]:
        if request_id in self._seqs or request_id in self._held or request_id in self._reserved:
            raise ValueError(f"request_id: {request_id!r} is already in use; pass a new id")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt: the prompt is empty; pass at least one token")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids: token id {t!r} at index {i} is outside the "
                                 f"vocabulary [0, {vocab}); pass ids below vocab_size")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds max_model_len "
                             f"{self.max_model_len}; lower max_tokens or shorten the prompt")
        if -(-total // self.block_size) > self.num_blocks:
            raise ValueError(f"max_tokens: prompt + max_tokens = {total} tokens needs more KV "
                             f"blocks than the pool has ({self.num_blocks} of "
                             f"{self.block_size}); lower max_tokens or raise kv_cache_bytes")
        return ids

    def prompt_logits(self, token_ids: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Score a prompt: (num_cached_tokens, fp32 logits [n - cached, vocab] of positions
        cached..n-1). Runs in chunks of max_num_batched_tokens through the same paged path as
        step(), then frees its blocks (full blocks stay cached). Needs no other request running.
        """
        if self.batcher.has_unfinished():
            raise ValueError("prompt_logits: the engine is busy; finish or abort requests first")
        rid = "__prompt_logits__"
        ids = self._validate(rid, token_ids, SamplingParams(max_tokens=1))
        seq = Seq(RequestId(rid), ids, len(ids), 1, self.block_size, self.namespace)
        cached = self.block_manager.allocate(rid, len(ids), seq.block_keys)
        if cached is None:
            raise ValueError("prompt_logits: the prompt does not fit in the free KV blocks")
        table = {rid: self.block_manager.block_ids(rid)}
        parts = []
        try:
            for start in range(cached, len(ids), self.config.max_num_batched_tokens):
                n = min(self.config.max_num_batched_tokens, len(ids) - start)
                plan = BatchPlan([ScheduledChunk(rid, start, n, start + n == len(ids))])
                parts.append(self.runner.run(plan, {rid: seq}, table, all_rows=True))
            self.block_manager.cache_full_blocks(rid, seq.block_keys)
        finally:
            self.block_manager.free(rid)
        return cached, torch.cat(parts)

    # -- prefix cache by key -----------------------------------------------------------------
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


def max_model_len_of(model_config: ModelConfig, config: EngineConfig) -> int:
    """The longest sequence an engine serves: its setting, capped at the model's positions."""
    return min(config.max_model_len or model_config.max_position_embeddings,
               model_config.max_position_embeddings)


def load_model(model: str, source: ModelSource, config: EngineConfig,
               layers: range | None = None) -> LlamaModel:
    """The model (or its `layers` slice) with its weights; ValueError naming what is wrong when
    a weight is missing or the weights and config.json disagree."""
    llama = LlamaModel(source.config, layers)
    try:
        llama.load_hf_state_dict(load_weights(source, config.seed))
    except KeyError as exc:
        raise ValueError(f"model: weight {exc.args[0]!r} is missing from {model!r}") from None
    except (RuntimeError, ValueError) as exc:  # weights and config.json disagree
        raise ValueError("model: " + " ".join(str(exc).split())) from None
    return llama


def kv_namespace(model_config: ModelConfig, config: EngineConfig, *,
                 from_directory: bool) -> str:
    """The namespace of this engine's block keys (`hashing.block_keys`): the model, its
    weights, the KV dtype and the block size. Engines (and the layer stages of one CPP group)
    share cached KV exactly when their namespaces are equal."""
    weights = "hf" if from_directory else f"seed{config.seed}"
    return f"kvcake/{model_config.name}/{weights}/{config.dtype}/b{config.block_size}"


def _linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available; use cpu")
    return torch.device(device)

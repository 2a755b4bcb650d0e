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

import torch

from kvcake.clock import Clock, SystemClock
from kvcake.engine import heap
from kvcake.engine.batcher import Batcher, BatchPlan, ScheduledChunk
from kvcake.engine.block_manager import BlockManager
from kvcake.engine.build import (
    DTYPES,
    attention_mode,
    kv_namespace,
    load_model,
    max_model_len_of,
    pick_device,
    tune_linears,
)
from kvcake.engine.config import EngineConfig, ModelConfig
from kvcake.engine.handoff import KvHandoff
from kvcake.engine.kv_exchange import KvExchange
from kvcake.engine.kv_pool import KvAllocator, KVPool
from kvcake.engine.linear import BUCKET_NAMES
from kvcake.engine.loader import resolve
from kvcake.engine.output import RequestOutput, request_output
from kvcake.engine.runner import ALL_ROWS, SAMPLING_ROWS, LogitRows, ModelRunner
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
from kvcake.types import BlockId, RequestId

__all__ = ["Engine", "RequestOutput", "kv_namespace", "load_model", "max_model_len_of"]

log = logging.getLogger(__name__)


class Engine(KvHandoff, KvExchange):
    """One instance; the hand-off (`KvHandoff`) and by-key (`KvExchange`) methods are parts."""


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
        self.device = pick_device(self.config.device)
        if self.device.type == "cpu":
            heap.keep_freed_memory()  # a step's activations: no page faults on the next step
        self.dtype = DTYPES[self.config.dtype]
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
        self.linear_choices = tune_linears(self.model, self.config.linear_backend)
        self.attention = attention_mode(self.config.attention, self.device)
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
        if plan.admitted_ids:  # their queue time ends here (a decode-only step skips this)
            start_s = self.clock.now_s()
            for request_id in plan.admitted_ids:
                self._seqs[request_id].first_scheduled_s = start_s
        tables = {c.request_id: self.block_manager.block_ids(c.request_id) for c in plan.chunks}
        prompt_rows = {c.request_id: self._seqs[c.request_id].num_prompt_tokens - 1
                       for c in plan.chunks if c.request_id in self._prompt_lp}
        rows = LogitRows(prompt_rows=prompt_rows) if prompt_rows else SAMPLING_ROWS
        logits = self.runner.run(plan, self._seqs, tables, layer_hook, rows=rows)
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
                outputs.append(request_output(
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
                parts.append(self.runner.run(plan, {rid: seq}, table, rows=ALL_ROWS))
            self.block_manager.cache_full_blocks(rid, seq.block_keys)
        finally:
            self.block_manager.free(rid)
        return cached, torch.cat(parts)

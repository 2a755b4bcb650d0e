"""`StageEngine`: one pipeline stage of chunked pipeline parallelism (CPP), a prefill engine that
holds a contiguous slice of the decoder's layers.

The stage loads only its layers' weights (plus the embedding on the first stage, the final norm
and lm_head on the last) and owns a paged KV pool of its layers only (pool layer i is decoder
layer `layers[i]`). A prompt is computed chunk by chunk: `begin` allocates the request's blocks,
`run_chunk(start, n, hidden)` runs one chunk through the slice and returns its hidden states
(every row, for the next stage) or, on the last stage, the first token once the final chunk is
in (sampled as `Engine.step` does: min_tokens, penalties, log probabilities if asked; prompt log
probabilities if asked, chunk by chunk from every prompt row's logits: `prompt_logprobs`).
Chunks must come in order; the attention of chunk i reads the KV chunks 0..i-1 left in this
stage's pool. `layer_view(block, layer)` is the zero-copy bytes of one of its layers of one
block, for streaming it to a decode engine (`KVPool.layer_offset_bytes` there, with the decoder
layer index). Single-threaded, like `Engine`; nothing here starts a thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from kvcake.clock import Clock, SystemClock
from kvcake.engine import heap
from kvcake.engine.batcher import BatchPlan, ScheduledChunk
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
from kvcake.engine.kv_pool import KVPool
from kvcake.engine.loader import resolve
from kvcake.engine.runner import SAMPLING_ROWS, LogitRows, ModelRunner
from kvcake.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    suppress_tokens,
    token_logprob,
    token_logprobs,
)
from kvcake.engine.sequence import Sequence as Seq
from kvcake.types import BlockId, RequestId


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """`num_layers` cut into `num_stages` contiguous slices, sizes differing by at most one
    (the earlier stages get the extra layers: the first also embeds, the last also samples)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cpp nodes: {num_stages} stages for a {num_layers}-layer model; "
                         f"use 1..{num_layers}")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class StageEngine:
    def __init__(self, model: str, layers: range, config: EngineConfig | None = None,
                 clock: Clock | None = None) -> None:
        """ValueError for a bad model (as `Engine`) or a `layers` slice outside the model."""
        self.config = config or EngineConfig()
        self.clock = clock or SystemClock()
        source = resolve(model)
        self.model_config: ModelConfig = source.config
        self.device = pick_device(self.config.device)
        if self.device.type == "cpu":
            heap.keep_freed_memory()  # as Engine: no page faults on the next chunk
        self.dtype = DTYPES[self.config.dtype]
        self.block_size = self.config.block_size
        mc = self.model_config
        self.max_model_len = max_model_len_of(mc, self.config)
        self.namespace = kv_namespace(mc, self.config, from_directory=source.directory is not None)
        self.model = load_model(model, source, self.config, layers)
        self.layers = self.model.layer_range
        self.model.to(device=self.device, dtype=self.dtype).eval()
        slice_config = dataclasses.replace(mc, num_layers=len(self.layers))
        num_blocks = self.config.num_blocks or max(1, self.config.kv_cache_bytes // (
            KVPool.bytes_per_block(slice_config, self.block_size, self.dtype)))
        self.pool = KVPool(slice_config, num_blocks, self.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, self.block_size, False)
        tune_linears(self.model, self.config.linear_backend)
        # as Engine: prompt chunks through the prefill-attention op where it loads (was SDPA
        # over gathered KV on every stage: its cost grows with the context)
        self.attention = attention_mode(self.config.attention, self.device)
        self.runner = ModelRunner(self.model, self.pool, self.device,
                                  paged_attention=self.attention == "kernel")
        self.sampler = Sampler()
        self._seqs: dict[str, tuple[Seq, SamplingParams]] = {}
        self._logprobs: dict[str, TokenLogprob] = {}  # first tokens' (requests that asked)
        self._prompt_lp: dict[str, list[TokenLogprob]] = {}  # prompt tokens 1.. (those that asked)

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @property
    def hidden_size(self) -> int:
        return self.model_config.hidden_size

    def begin(self, request_id: str, prompt_token_ids: Sequence[int],
              sampling_params: SamplingParams | None = None) -> bool:
        """Allocate the blocks of a prompt about to flow through; False (nothing changed) when
        the pool has no room now. ValueError for a bad prompt or a request already here."""
        params = sampling_params or SamplingParams()
        ids = [int(t) for t in prompt_token_ids]
        if request_id in self._seqs:
            raise ValueError(f"request_id: {request_id!r} is already in this stage")
        if not ids or len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: 1..{self.max_model_len - 1} tokens, got {len(ids)}")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        seq = Seq(RequestId(request_id), ids, len(ids), params.max_tokens, self.block_size,
                  self.namespace, prefill_only=True, arrival_s=self.clock.now_s())
        if self.block_manager.allocate(request_id, len(ids), []) is None:
            return False
        self._seqs[request_id] = (seq, params)
        return True

    def run_chunk(self, request_id: str, start: int, num_tokens: int,
                  hidden: Tensor | None = None,
                  layer_hook: Callable[[int], None] | None = None) -> Tensor | int:
        """Compute prompt tokens start..start+num_tokens-1 through this slice. Returns their
        hidden states [num_tokens, hidden_size] (a stage before the last), or, on the last
        stage, the first sampled token when this chunk ends the prompt (else an empty tensor).
        `layer_hook(decoder_layer)` runs once each layer's KV of the chunk is in the pool."""
        seq, params = self._seqs[request_id]
        if num_tokens < 1 or start < 0 or start + num_tokens > len(seq.token_ids):
            raise ValueError(f"chunk: tokens {start}..{start + num_tokens} outside the prompt "
                             f"of {len(seq.token_ids)}")
        final = start + num_tokens == len(seq.token_ids)
        plan = BatchPlan([ScheduledChunk(request_id, start, num_tokens, final)])
        tables = {request_id: self.block_manager.block_ids(request_id)}
        if hidden is not None:
            hidden = hidden.to(self.device)
        last_row = len(seq.token_ids) - 1  # the logits at position p score prompt token p + 1
        prompt_rows = {request_id: last_row} \
            if self.is_last and params.prompt_logprobs is not None else None
        rows = SAMPLING_ROWS if prompt_rows is None else LogitRows(prompt_rows=prompt_rows)
        out = self.runner.run(plan, {request_id: seq}, tables, layer_hook, hidden=hidden,
                              rows=rows)
        seq.num_computed_tokens = start + num_tokens
        if not self.is_last:
            return out
        if prompt_rows is not None:  # the sampling row (final chunk) first, then the prompt's
            count = max(0, min(start + num_tokens, last_row) - start)
            found = self._prompt_lp.setdefault(request_id, [])
            del found[start:]
            found.extend(token_logprobs(out[int(final):int(final) + count],
                                        list(seq.token_ids[start + 1:start + 1 + count]),
                                        params.prompt_logprobs or 0))
            out = out[:int(final)]
        if not final:
            return torch.empty(0)
        return self._sample_first(request_id, seq, params, out)

    def _sample_first(self, request_id: str, seq: Seq, params: SamplingParams,
                      logits: Tensor) -> int:
        """The first token as `Engine.step` samples it: min_tokens masks the stop ids (and EOS),
        penalties over the prompt, then the sampler; its log probabilities if asked."""
        with torch.inference_mode():
            if params.min_tokens > 0:
                eos = () if params.ignore_eos else self.model_config.eos_token_ids
                suppress_tokens(logits, [0], [params.stop_token_ids + eos])
            if params.penalized:
                apply_penalties(logits, 0, list(seq.token_ids), [], params)
        token = self.sampler.sample(logits, [request_id], [params])[0]
        if params.logprobs is not None:
            self._logprobs[request_id] = token_logprob(logits[0], token, params.logprobs)
        return token

    def prompt_logprobs(self, request_id: str) -> list[TokenLogprob] | None:
        """Log probabilities of prompt tokens 1.. (a request that asked, on the last stage,
        once its chunks from token 0 on are computed)."""
        return self._prompt_lp.get(request_id)

    def first_token_logprobs(self, request_id: str) -> TokenLogprob | None:
        """The first token's log probabilities (a request that asked, on the last stage)."""
        return self._logprobs.get(request_id)

    def sampler_state(self, request_id: str) -> bytes | None:
        return self.sampler.export_state(request_id)

    def block_ids(self, request_id: str) -> list[BlockId]:
        return self.block_manager.block_ids(request_id)

    def layer_view(self, block_id: BlockId, layer: int) -> memoryview:
        """Zero-copy bytes of decoder layer `layer` (one of this stage's) of one block."""
        if layer not in self.layers:
            raise ValueError(f"layer: {layer} is not in this stage's slice {self.layers}")
        t = self.pool.layer(layer - self.layers.start)[block_id]
        return t.view(torch.uint8).numpy().reshape(-1).data

    def release(self, request_id: str) -> None:
        """Free a request's blocks (no-op for an unknown id)."""
        if self._seqs.pop(request_id, None) is not None:
            self.block_manager.free(request_id)
            self.sampler.forget(request_id)
            self._logprobs.pop(request_id, None)
            self._prompt_lp.pop(request_id, None)

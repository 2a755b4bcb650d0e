"""A Llama-family decoder (RMSNorm, RoPE with optional Llama-3 scaling, GQA, SwiGLU) on paged KV.

The model computes; it decides nothing. One forward takes the flat tokens of every scheduled
sequence (prefill chunks and decode steps mixed) plus an `AttentionBatch` that says, per
sequence, where its queries sit in the flat batch, how long its context is and which KV blocks
hold it. Each layer writes its new K/V into the pool before attending, then calls the optional
`layer_hook(layer_idx)` so a worker can stream that layer's KV while later layers compute.

Weights are held in Hugging Face naming at load time and fused here (q|k|v and gate|up) so each
layer does four matmuls instead of seven.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvcake.engine import cpu_ops, decode_layers
from kvcake.engine.config import ModelConfig
from kvcake.engine.cpu_ops import paged_decode_attention, paged_prefill_attention
from kvcake.engine.decode_layers import DecodeLayers
from kvcake.engine.kv_pool import KVPool
from kvcake.engine.linear import Linear
from kvcake.engine.rope import apply_rope, rope_inv_freq


@dataclass
class AttentionBatch:
    """Per-forward attention metadata (built by the runner, read by every layer).

    A layer of the pool is addressed as rows: [num_blocks * 2 * block_size, H, D], where the
    K of position p of a sequence is row block_ids[p // bs] * 2 * bs + p % bs and its V is
    that row + bs. Gathering a context is then one index_select for K and one for V.

    prefill: sequences with more than one query token, each (q_start, q_len, ctx_len, k_rows);
      queries are flat rows q_start..q_start+q_len at positions ctx_len-q_len..ctx_len-1;
      k_rows [ctx_len] are the K rows of the whole context, or None when there is no cached
      prefix (ctx_len == q_len: attend to the fresh K/V directly).
    decode: single-token sequences in groups of similar context length, each attended in one
      padded call: (rows [B] of the flat batch, k_rows [B, max_ctx], mask [B, 1, 1, max_ctx]).
    paged: single-token sequences attended in place by the paged-attention op (no gather, no
      padding): (rows [B] of the flat batch, block tables [B, max_blocks] padded with any valid
      block id, context lengths [B]); used instead of `decode` when the op is loaded.
    prefill_paged: prompt chunks attended in place by the prefill-attention op (fp32; no gather
      of a cached prefix, no mask): (q_start, q_len, ctx_len, block table [ceil(ctx_len / bs)]);
      used instead of `prefill` when the op applies.
    k_slots / v_slots: the rows where each flat token's K and V are written.
    """

    prefill: list[tuple[int, int, int, Tensor | None]]
    decode: list[tuple[Tensor, Tensor, Tensor]]
    k_slots: Tensor
    v_slots: Tensor
    block_size: int
    paged: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)
    prefill_paged: list[tuple[int, int, int, Tensor]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """One forward's flat token rows (built by the runner; the attention metadata is separate).

    input_ids / positions: [n] per flat row (a stage without layer 0 reads `hidden` instead of
    the ids); logit_rows: the flat rows whose logits a last stage returns; max_position: the
    largest of `positions` when the caller knows it (saves a device sync); hidden: a stage
    without layer 0: the previous stage's output [n, hidden_size]; every_row: `logit_rows` is
    every row in order (a decode step: the logits need no gather).
    """

    input_ids: Tensor
    positions: Tensor
    logit_rows: Tensor
    max_position: int | None = None
    hidden: Tensor | None = None
    every_row: bool = False


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # the same arithmetic, fewer calls (a decode step's ops
            # are small enough that each Python-level call shows)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps)))
        # Normalise in fp32 as transformers does, then cast back before the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.q_size, self.kv_size = config.num_heads * hd, config.num_kv_heads * hd
        self.qkv_proj = Linear(d, self.q_size + 2 * self.kv_size, bias=config.has_qkv_bias)
        self.o_proj = Linear(self.q_size, d, bias=config.attention_bias)
        self.gate_up_proj = Linear(d, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, d, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.scale = hd**-0.5
        self._fast: tuple[Any, ...] | None = None  # `_forward_fused`'s attributes, cached

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, kv: Tensor,
                batch: AttentionBatch) -> Tensor:
        if cpu_ops.fused(h):
            h, delta = self._forward_fused(h, None, (cos, sin), kv,
                                           kv.view(-1, self.num_kv_heads, self.head_dim), batch)
            return h + delta
        x = self.input_layernorm(h)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = h.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over the heads
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        rows = kv.view(-1, self.num_kv_heads, self.head_dim)
        rows.index_copy_(0, batch.k_slots, k)
        rows.index_copy_(0, batch.v_slots, v)
        attn = self._attend(q, k, v, kv, batch)
        h = h + self.o_proj(attn.reshape(n, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def _forward_fused(self, h: Tensor, pending: Tensor | None, rope: tuple[Tensor, Tensor],
                       kv: Tensor, kv_rows: Tensor,
                       batch: AttentionBatch) -> tuple[Tensor, Tensor]:
        """`forward` with the element-wise steps as single-pass ops (CPU fp32, `cpu_ops`). The
        residual stream is h + pending (the previous layer's last add, folded into this
        layer's first norm); returns this layer's output the same way, (h, delta). `rope`:
        cos [n, head_dim] and sin's first half [n, head_dim / 2]; `kv_rows`: the layer `kv` as
        rows [-1, num_kv_heads, head_dim] (`KVPool.layer_rows`)."""
        h, q, k, v = self._fused_qkv(h, pending, rope, kv_rows, batch)
        attn = self._attend(q, k, v, kv, batch)
        return self._fused_out(h, attn.view(h.shape[0], self.q_size))

    def _fused_qkv(self, h: Tensor, pending: Tensor | None, rope: tuple[Tensor, Tensor],
                   kv_rows: Tensor, batch: AttentionBatch) -> tuple[Tensor, ...]:
        """The fused layer up to attention, every row: (h with pending added, q, k, v), RoPE
        applied and each row's K and V written to `kv_rows`."""
        ops = cpu_ops.fused_ops()
        fast = self._fast if self._fast is not None else self._fast_attrs()
        qkv_proj, in_w, in_eps = fast[0], fast[4], fast[5]
        if pending is None:
            x = ops.rms_norm(h, in_w, in_eps)
        else:
            h, x = ops.add_rms_norm(h, pending, in_w, in_eps)
        q, k, v = ops.rope_qkv_store(qkv_proj(x), rope[0], rope[1], kv_rows, batch.k_slots,
                                     batch.v_slots, self.num_heads, self.num_kv_heads)
        return h, q, k, v

    def _fused_out(self, h: Tensor, attn: Tensor) -> tuple[Tensor, Tensor]:
        """The fused layer after attention (`attn` [rows, q_size] of the rows of `h`): o_proj,
        the residual add and norm, the MLP; (h, delta) as `_forward_fused` returns them."""
        ops = cpu_ops.fused_ops()
        _, o_proj, gate_up_proj, down_proj, _, _, post_w, post_eps = self._fast or \
            self._fast_attrs()
        h, x = ops.add_rms_norm(h, o_proj(attn), post_w, post_eps)
        return h, down_proj(ops.silu_mul(gate_up_proj(x)))

    def _fast_attrs(self) -> tuple[Any, ...]:
        """The fused path's attributes as plain values, cached (nn.Module's __getattr__ is ~1 us
        a lookup)."""
        self._fast = (
            self.qkv_proj.forward, self.o_proj.forward, self.gate_up_proj.forward,
            self.down_proj.forward, self.input_layernorm.weight, self.input_layernorm.eps,
            self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self._fast

    def _forward_fused_rows(self, h: Tensor, pending: Tensor | None, rope: tuple[Tensor, Tensor],
                            kv: Tensor, batch: AttentionBatch,
                            rows: Tensor) -> tuple[Tensor, Tensor]:
        """`_forward_fused` for the model's last layer when only `rows` of its output are used
        (the rows that give logits): every row's K and V are still computed and written to the
        pool (later steps attend to them), but the attention, o_proj and the MLP run for
        `rows` only. Returns (h, delta) of `rows`, in their order. A cold 2,048-token prompt
        samples from one row: its last layer's attention and MLP, ~22% of the step's FLOPs at
        the serving model's shape, are not computed for the other 2,047."""
        m = rows.shape[0]
        kv_rows = kv.view(-1, self.num_kv_heads, self.head_dim)  # a prompt step's: one view
        h, q, k, v = self._fused_qkv(h, pending, rope, kv_rows, batch)
        if m == 0:  # no row samples (a prompt chunk that continues): only the KV was needed
            return h[:0], h[:0]
        attn = self._attend_rows(q, k, v, kv, batch, rows)
        return self._fused_out(h[rows], attn.reshape(m, self.q_size))

    def _attend_rows(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor, batch: AttentionBatch,
                     rows: Tensor) -> Tensor:
        """The attention output of the flat rows `rows` only. One prompt chunk whose rows are
        the chunk's last ones in order (its sampling row) is attended for those queries alone
        (the op takes the queries of the chunk's last positions); anything else is attended
        whole and then selected."""
        n, m = q.shape[0], rows.shape[0]
        if not batch.prefill and not batch.decode and not batch.paged \
                and len(batch.prefill_paged) == 1 and batch.prefill_paged[0][1] == n:
            suffix = int(rows[0]) == n - 1 if m == 1 else \
                bool(torch.equal(rows, torch.arange(n - m, n, device=rows.device)))
            if suffix:
                _, _, ctx_len, table = batch.prefill_paged[0]
                return paged_prefill_attention(q[n - m:], kv, table, ctx_len, self.scale)
        return self._attend(q, k, v, kv, batch)[rows]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor,
                batch: AttentionBatch) -> Tensor:
        if not batch.prefill and not batch.decode:
            if not batch.prefill_paged and len(batch.paged) == 1:
                _, tables, lens = batch.paged[0]  # a pure decode step: every row, in order
                return paged_decode_attention(q, kv, tables, lens, self.scale)
            if not batch.paged and len(batch.prefill_paged) == 1 \
                    and batch.prefill_paged[0][1] == q.shape[0]:
                _, _, ctx_len, table = batch.prefill_paged[0]  # one prompt chunk: every row
                return paged_prefill_attention(q, kv, table, ctx_len, self.scale)
        out = torch.empty_like(q)
        for q_start, q_len, ctx_len, table in batch.prefill_paged:
            out[q_start:q_start + q_len] = paged_prefill_attention(
                q[q_start:q_start + q_len], kv, table, ctx_len, self.scale)
        rows = kv.view(-1, self.num_kv_heads, self.head_dim)
        for q_start, q_len, ctx_len, k_rows in batch.prefill:
            qs = q[q_start:q_start + q_len].transpose(0, 1).unsqueeze(0)
            if k_rows is None:
                ks = k[q_start:q_start + q_len]
                vs = v[q_start:q_start + q_len]
                mask = None
            else:
                ks = rows.index_select(0, k_rows)
                vs = rows.index_select(0, k_rows + batch.block_size)
                pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
                mask = torch.arange(ctx_len, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)
            out[q_start:q_start + q_len] = o[0].transpose(0, 1)
        for decode_rows, decode_k_rows, decode_mask in batch.decode:
            b, ctx = decode_k_rows.shape
            k_rows = decode_k_rows.flatten()
            shape = (b, ctx, self.num_kv_heads, self.head_dim)
            ks = rows.index_select(0, k_rows).view(shape).transpose(1, 2)  # [B, H, ctx, D]
            vs = rows.index_select(0, k_rows + batch.block_size).view(shape).transpose(1, 2)
            qs = q[decode_rows].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=decode_mask,
                                               scale=self.scale, enable_gqa=True)
            out[decode_rows] = o.squeeze(2)
        for paged_rows, tables, lens in batch.paged:
            out[paged_rows] = paged_decode_attention(q[paged_rows], kv, tables, lens, self.scale)
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: range | None = None) -> None:
        """`layers`: the contiguous slice of the decoder this instance holds (a pipeline stage
        of chunked pipeline parallelism); None: all of them. A stage without layer 0 takes
        hidden states in (`forward(hidden=...)`) instead of token embeddings, and one without
        the last layer returns every row's hidden states instead of logits; only the weights
        its slice uses are created and loaded. The pool it runs on holds the slice's layers
        only (pool layer i is decoder layer layers[i]); `layer_hook` gets the decoder index."""
        super().__init__()
        self.config = config
        span = range(config.num_layers) if layers is None else layers
        if span.step != 1 or not 0 <= span.start < span.stop <= config.num_layers:
            raise ValueError(f"layers: a contiguous, non-empty slice of 0..{config.num_layers} "
                             f"is needed, got {span}")
        self.layer_range = span
        self.is_first = span.start == 0
        self.is_last = span.stop == config.num_layers
        tied = config.tie_word_embeddings
        if self.is_first or (self.is_last and tied):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in span)
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # (cos [positions, head_dim], sin's first half [positions, head_dim / 2])
        self._rope_cache: tuple[Tensor, Tensor] | None = None
        self._decode_layers = DecodeLayers(list(self.layers))  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, batch: AttentionBatch, pool: KVPool,
                layer_hook: Callable[[int], None] | None = None) -> Tensor:
        """Logits (fp32) of the flat rows `inputs.logit_rows` only: one per sequence that
        samples. A stage without the last layer returns the hidden states of every row instead,
        and one without the first layer starts from `inputs.hidden` (the previous stage's)."""
        input_ids, hidden, logit_rows = inputs.input_ids, inputs.hidden, inputs.logit_rows
        if self.is_first:
            h = self.embed_tokens(input_ids)
        elif hidden is None or hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"hidden: a stage from layer {self.layer_range.start} needs the "
                             f"previous stage's hidden states [{input_ids.shape[0]}, "
                             f"{self.config.hidden_size}]")
        else:
            h = hidden.to(dtype=next(self.layers.parameters()).dtype)
        cos, sin = self._rope(inputs.positions, h.dtype, inputs.max_position)
        first = self.layer_range.start
        fused = cpu_ops.fused(h)  # decided once per forward (a check per layer showed in a step)
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        pending: Tensor | None = None  # fused path: the residual stream is h + pending
        views, kv_rows = pool.layer_views, pool.layer_rows
        n = h.shape[0]
        every_row = inputs.every_row or (n == 1 and logit_rows.shape[0] == 1)
        # The last layer's output is read at the logit rows only: when they are fewer than the
        # rows, that layer computes them alone (every row's KV is still written).
        trim = fused and self.is_last and logit_rows.shape[0] < n
        # a pure decode step: every layer in one C++ call (the same ops, bit-identical)
        one_call = fused and layer_hook is None and not trim and decode_layers.applies(batch)
        if one_call:
            h, pending = self._decode_layers(h, pending, (cos, sin), views, kv_rows, batch)
        for idx, layer in enumerate(() if one_call else layers):
            if trim and idx == len(layers) - 1:  # h, pending: of the logit rows, in order
                h, pending = layer._forward_fused_rows(h, pending, (cos, sin), views[idx],
                                                       batch, logit_rows)
            elif fused:  # direct call: nn.Module's __call__ is measurable at decode sizes
                h, pending = layer._forward_fused(h, pending, (cos, sin), views[idx],
                                                  kv_rows[idx], batch)
            else:
                h = layer(h, cos, sin, views[idx], batch)
            if layer_hook is not None:
                layer_hook(first + idx)
        if not self.is_last:
            return h if pending is None else h + pending
        if not (trim or every_row):  # only the rows that give logits need the last add
            h = h[logit_rows]
            pending = None if pending is None else pending[logit_rows]
        if pending is None:
            logits = self.lm_head.forward(self.norm.forward(h))
        else:  # the last add and the final norm in one pass
            norm = self.norm
            logits = self.lm_head.forward(
                cpu_ops.fused_ops().add_rms_norm(h, pending, norm.weight, norm.eps)[1])
        return logits if logits.dtype == torch.float32 else logits.float()

    def _rope(self, positions: Tensor, dtype: torch.dtype,
              max_position: int | None = None) -> tuple[Tensor, Tensor]:
        """cos [n, head_dim] and the first half of sin [n, head_dim / 2] (its halves are equal)
        of `positions`, from caches grown on demand (one gather each: the fused ops' layout)."""
        need = (int(positions.max().item()) if max_position is None else max_position) + 1
        if self._rope_cache is None or self._rope_cache[0].shape[0] < need \
                or self._rope_cache[0].dtype != dtype:
            size = max(need, 1 << (need - 1).bit_length(), 1024)
            pos = torch.arange(size, dtype=torch.float32, device=positions.device)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache = (emb.cos().to(dtype),
                                emb.sin()[:, :self.config.head_size // 2].to(dtype).contiguous())
        return self._rope_cache[0][positions], self._rope_cache[1][positions]

    def load_hf_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load weights named as in transformers' LlamaForCausalLM (fusing qkv and gate|up)."""
        cfg = self.config
        own: dict[str, Tensor] = {}
        if hasattr(self, "embed_tokens"):
            own["embed_tokens.weight"] = state["model.embed_tokens.weight"]
        if self.is_last:
            own["norm.weight"] = state["model.norm.weight"]
            if not cfg.tie_word_embeddings:
                own["lm_head.weight"] = state["lm_head.weight"]
        for i, layer in enumerate(self.layer_range):  # i: this slice's index, layer: decoder's
            p = f"model.layers.{layer}."
            own[f"layers.{i}.qkv_proj.weight"] = torch.cat(
                [state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            own[f"layers.{i}.o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
            if cfg.has_qkv_bias:  # Qwen2: q, k, v only
                own[f"layers.{i}.qkv_proj.bias"] = torch.cat(
                    [state[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            if cfg.attention_bias:
                own[f"layers.{i}.o_proj.bias"] = state[p + "self_attn.o_proj.bias"]
            own[f"layers.{i}.gate_up_proj.weight"] = torch.cat(
                [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
            own[f"layers.{i}.down_proj.weight"] = state[p + "mlp.down_proj.weight"]
            if cfg.mlp_bias:
                own[f"layers.{i}.gate_up_proj.bias"] = torch.cat(
                    [state[p + "mlp.gate_proj.bias"], state[p + "mlp.up_proj.bias"]])
                own[f"layers.{i}.down_proj.bias"] = state[p + "mlp.down_proj.bias"]
            for norm in ("input_layernorm", "post_attention_layernorm"):
                own[f"layers.{i}.{norm}.weight"] = state[p + f"{norm}.weight"]
        params = dict(self.named_parameters())
        for name, tensor in own.items():
            if name in params and params[name].shape != tensor.shape:
                raise ValueError(f"weights do not match config.json: {name} has shape "
                                 f"{tuple(tensor.shape)}, the config implies "
                                 f"{tuple(params[name].shape)}")
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights: missing {missing[:5]}, unexpected {unexpected[:5]}")

"""A pure decode step's decoder layers as one call to kvcake's C++ loop (`decode_layers`).

The fused layer (`DecoderLayer._forward_fused`) is eleven op calls; from Python each costs the
interpreter and the binding layer a few microseconds, which at batch 1 added up to ~10% of a
decode step (benchmarks/decode_host_share.py, docs/benchmarks.md). `torch.ops.kvcake.decode_layers`
(csrc/decode_layers.cpp) makes the same calls with the same kernels through the dispatcher, so
its output is bit-identical to the Python loop's. This module gathers its operands: per layer
the norms' weights and, per linear product, the backend `linear.tune` chose for the step's row
count and the tensors that backend reads. They are built once per row bucket and kept until a
kernel changes (`linear.generation`).

Only a pure decode step qualifies (`applies`): one query per sequence, all attended in place by
the paged-attention op, CPU fp32 with kvcake's ops loaded. Prompt chunks, mixed steps and steps
with a layer hook (layer-wise KV streaming) stay on the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from kvcake.engine import cpu_ops, linear
from kvcake.engine.linear import Linear, bucket_of

if TYPE_CHECKING:
    from kvcake.engine.model import AttentionBatch, DecoderLayer


def applies(batch: AttentionBatch) -> bool:
    """Whether `batch` is a pure decode step: every row one sequence's single query, attended in
    order by the paged-attention op (the step `DecoderLayer._attend` sends to it whole)."""
    return not batch.prefill and not batch.decode and not batch.prefill_paged \
        and len(batch.paged) == 1


class DecodeLayers:
    """The C++ decode loop over `layers` (a model's, or a pipeline stage's, decoder layers)."""

    def __init__(self, layers: Sequence[DecoderLayer]) -> None:
        self._layers = tuple(layers)
        first = self._layers[0]
        self._heads = (first.num_heads, first.num_kv_heads)
        self._scale = first.scale
        self._norms = ([w for layer in self._layers for w in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight)],
            [eps for layer in self._layers for eps in (
                layer.input_layernorm.eps, layer.post_attention_layernorm.eps)])
        self._plans: dict[int, tuple[Any, ...]] = {}
        self._generation = -1

    def __call__(self, h: Tensor, pending: Tensor | None, rope: tuple[Tensor, Tensor],
                 kv: Sequence[Tensor], kv_rows: Sequence[Tensor],
                 batch: AttentionBatch) -> tuple[Tensor, Tensor]:
        """Every layer's `_forward_fused` on the decode step `batch` (`applies`): (h, delta)
        of the last layer. `kv` / `kv_rows`: the pool's layer views and rows
        (`KVPool.layer_views`, `KVPool.layer_rows`) of these layers."""
        _, tables, lens = batch.paged[0]
        return cpu_ops.fused_ops().decode_layers(
            h, pending, rope[0], rope[1], kv, kv_rows, batch.k_slots, batch.v_slots, tables,
            lens, *self._norms, *self._products(h.shape[0]), self._scale, *self._heads)

    def _products(self, rows: int) -> tuple[Any, ...]:
        """The linear products' operands for `rows` rows, as the op's arguments from
        `backends` to `split_weights`."""
        if self._generation != linear.generation():
            self._plans.clear()
            self._generation = linear.generation()
        bucket = 0 if rows == 1 else bucket_of(rows)
        plan = self._plans.get(bucket)
        if plan is None:
            plan = self._plans[bucket] = self._build(bucket)
        return plan

    def _build(self, bucket: int) -> tuple[Any, ...]:
        backends: list[int] = []
        weights: list[Tensor] = []
        biases: list[Tensor | None] = []
        packed: list[Tensor | None] = []
        counts: list[int] = []
        split_packed: list[Tensor] = []
        split_weights: list[Tensor] = []
        for layer in self._layers:
            for product in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                code, pack, packs, parts = _operands(product, bucket)
                backends.append(code)
                weights.append(product.weight)
                biases.append(product.bias)
                packed.append(pack)
                counts.append(len(parts))
                split_packed += packs
                split_weights += parts
        return backends, weights, biases, packed, counts, split_packed, split_weights


def _operands(product: Linear, bucket: int) -> tuple[int, Tensor | None, list[Tensor],
                                                     list[Tensor]]:
    kernel = product.kernel
    if kernel is None:  # untuned: torch's default, as `Linear.forward`
        return linear.BACKENDS.index("aten"), None, [], []
    return kernel.operands(bucket)

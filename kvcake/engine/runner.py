"""Model runner: turns a `BatchPlan` into tensors, runs one forward, returns sampling logits.

Mechanism only (torch). The block tables come from the block manager; the runner computes each
token's slot (block id, offset) from its position:

  position p of a sequence  ->  block block_ids[p // block_size], offset p % block_size
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcake.engine import cpu_ops
from kvcake.engine.batcher import BatchPlan
from kvcake.engine.kv_pool import KVPool
from kvcake.engine.model import AttentionBatch, ForwardInputs, LlamaModel
from kvcake.engine.sequence import Sequence
from kvcake.types import BlockId

# Decode batches split in two by context length when the shorter half needs at most this share
# of the longer half's blocks (and each half has at least DECODE_SPLIT_MIN_ROWS rows).
DECODE_SPLIT_RATIO = 0.75
DECODE_SPLIT_MIN_ROWS = 4


@dataclass(frozen=True)
class LogitRows:
    """Which rows' logits `ModelRunner.run` returns. all_rows: every scheduled token's, in plan
    order (instead of one per sampling chunk); prompt_rows (request id -> end position E):
    after those, the logits of each such chunk's tokens at positions < E, in chunk order
    (prompt log probabilities)."""

    all_rows: bool = False
    prompt_rows: Mapping[str, int] | None = None


SAMPLING_ROWS = LogitRows()  # one row per sampling chunk: what a step samples from
ALL_ROWS = LogitRows(all_rows=True)  # every scheduled token: scoring a prompt


def _long_tensor(values: list[int]) -> Tensor:
    """int64 CPU tensor of `values` (through an `array`: about half of `torch.tensor`'s time for
    a step's few hundred ints; the tensor keeps the array alive)."""
    return torch.frombuffer(array("q", values), dtype=torch.long) if values else \
        torch.empty(0, dtype=torch.long)


class _FlatRows:
    """A plan's scheduled tokens as flat int lists, one row per token, before the device."""

    __slots__ = ("input_ids", "positions", "k_slots", "logit_rows", "extra_rows", "prefill",
                 "decode_rows", "decode_tables", "decode_lens", "paged_prefill", "prefill_tables")

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.k_slots: list[int] = []
        self.logit_rows: list[int] = []
        self.extra_rows: list[int] = []
        self.prefill: list[tuple[int, int, int, Tensor | None]] = []
        self.decode_rows: list[int] = []
        self.decode_tables: list[list[BlockId]] = []
        self.decode_lens: list[int] = []
        self.paged_prefill: list[tuple[int, int, int]] = []  # (row, q_len, ctx_len)
        self.prefill_tables: list[int] = []  # the paged prefill chunks' tables, concatenated


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, device: torch.device,
                 paged_attention: bool = False) -> None:
        """`paged_attention`: decode rows go to the paged-attention op (`AttentionBatch.paged`,
        the op must be loaded) instead of padded, gathered groups, and prompt chunks to the
        prefill-attention op (`AttentionBatch.prefill_paged`) where it applies (fp32)."""
        self.model = model
        self.pool = pool
        self.device = device
        self.block_size = pool.block_size
        self.paged_attention = paged_attention
        self.paged_prefill = paged_attention and device.type == "cpu" and \
            cpu_ops.paged_prefill_supported(model.config.head_size, pool.kv.dtype)

    def run(self, plan: BatchPlan, seqs: Mapping[str, Sequence],
            tables: Mapping[str, list[BlockId]],
            layer_hook: Callable[[int], None] | None = None, *,
            hidden: Tensor | None = None, rows: LogitRows = SAMPLING_ROWS) -> Tensor:
        """Logits of the rows `rows` selects (by default [num sampling chunks, vocab] in the
        order of the sampling chunks of `plan`). For a layer-slice model (a pipeline stage, see
        `LlamaModel`): `hidden` is the previous stage's output for the plan's tokens, and a
        stage without the last layer returns every token's hidden states."""
        flat = self._flatten(plan, seqs, tables, rows)
        inputs, batch = self._tensors(flat, hidden)
        return self.model(inputs, batch, self.pool, layer_hook)

    def _flatten(self, plan: BatchPlan, seqs: Mapping[str, Sequence],
                 tables: Mapping[str, list[BlockId]], rows: LogitRows) -> _FlatRows:
        """The plan's tokens as flat rows: ids, positions, K slots, each chunk's attention."""
        bs = self.block_size
        flat = _FlatRows()
        prompt_rows = rows.prompt_rows
        for chunk in plan.chunks:
            seq, table = seqs[chunk.request_id], tables[chunk.request_id]
            row = len(flat.input_ids)
            end = chunk.start + chunk.num_tokens
            flat.input_ids.extend(seq.token_ids[chunk.start:end])
            pos = range(chunk.start, end)
            flat.positions.extend(pos)
            # Layer rows are [block][K|V][offset]: K of position p sits at b*2*bs + p%bs.
            flat.k_slots.extend(table[p // bs] * 2 * bs + p % bs for p in pos)
            num_ctx_blocks = -(-end // bs)
            if chunk.num_tokens == 1 and chunk.start > 0:
                flat.decode_rows.append(row)
                flat.decode_tables.append(table[:num_ctx_blocks])
                flat.decode_lens.append(end)
            elif self.paged_prefill:
                flat.paged_prefill.append((row, chunk.num_tokens, end))
                flat.prefill_tables.extend(table[:num_ctx_blocks])
            else:
                k_rows = None if chunk.start == 0 else \
                    self._k_rows(self._long(table[:num_ctx_blocks])).flatten()[:end]
                flat.prefill.append((row, chunk.num_tokens, end, k_rows))
            if rows.all_rows:
                flat.logit_rows.extend(range(row, row + chunk.num_tokens))
            elif chunk.samples:
                flat.logit_rows.append(row + chunk.num_tokens - 1)
            if prompt_rows and chunk.request_id in prompt_rows:
                stop = min(end, prompt_rows[chunk.request_id])
                flat.extra_rows.extend(range(row, row + max(0, stop - chunk.start)))
        flat.logit_rows.extend(flat.extra_rows)
        return flat

    def _tensors(self, flat: _FlatRows,
                 hidden: Tensor | None) -> tuple[ForwardInputs, AttentionBatch]:
        """The flat rows on the device: the forward's inputs and its attention metadata."""
        bs = self.block_size
        # Every int list of the step goes to the device as one tensor, then views of it: a
        # torch.tensor call per list was a measurable share of a decode step.
        # The V slots are listed too (each K slot + block_size): an add op on the device cost
        # more than the list at decode sizes.
        parts: list[list[int]] = [flat.input_ids, flat.positions, flat.k_slots,
                                  [s + bs for s in flat.k_slots], flat.logit_rows,
                                  flat.prefill_tables]
        decode_rows, decode_tables = flat.decode_rows, flat.decode_tables
        paged = bool(decode_rows) and self.paged_attention
        width = max((len(t) for t in decode_tables), default=0)
        if paged:
            parts += [decode_rows, flat.decode_lens,
                      [b for t in decode_tables for b in (*t, *[0] * (width - len(t)))]]
        flat_values = [v for part in parts for v in part]
        values = _long_tensor(flat_values) if self.device.type == "cpu" else \
            self._long(flat_values)
        views = torch.split_with_sizes(values, [len(part) for part in parts])
        ids_t, pos_t, k, v, logit_t, prefill_tables = views[:6]
        batch = AttentionBatch(prefill=flat.prefill, decode=[], k_slots=k, v_slots=v,
                               block_size=bs)
        offset = 0
        for row, q_len, ctx_len in flat.paged_prefill:
            blocks = -(-ctx_len // bs)
            batch.prefill_paged.append((row, q_len, ctx_len,
                                        prefill_tables[offset:offset + blocks]))
            offset += blocks
        if paged:
            batch.paged.append((views[6], views[8].view(len(decode_rows), width), views[7]))
        elif decode_rows:
            self._fill_decode(batch, decode_rows, decode_tables, flat.decode_lens)
        n = len(flat.input_ids)
        every_row = len(flat.logit_rows) == n and flat.logit_rows == list(range(n))
        inputs = ForwardInputs(ids_t, pos_t, logit_t, max(flat.positions), hidden, every_row)
        return inputs, batch

    def _fill_decode(self, batch: AttentionBatch, rows: list[int],
                     tables: list[list[BlockId]], lens: list[int]) -> None:
        # Split at the median context length when that halves the shorter half's padding
        # enough: padded attention reads (and gathers) max_ctx positions for every sequence.
        order = sorted(range(len(rows)), key=lambda i: lens[i])
        half = len(order) // 2
        groups = [order]
        if half >= DECODE_SPLIT_MIN_ROWS and \
                len(tables[order[half - 1]]) <= DECODE_SPLIT_RATIO * len(tables[order[-1]]):
            groups = [order[:half], order[half:]]
        for group in groups:
            max_blocks = max(len(tables[i]) for i in group)
            padded = [list(tables[i]) + [0] * (max_blocks - len(tables[i])) for i in group]
            ctx = torch.arange(max_blocks * self.block_size, device=self.device)
            mask = ctx[None, :] < self._long([lens[i] for i in group])[:, None]
            batch.decode.append((self._long([rows[i] for i in group]),
                                 self._k_rows(self._long(padded)).flatten(-2),
                                 mask[:, None, None, :]))

    def _k_rows(self, block_ids: Tensor) -> Tensor:
        """[..., nb] block ids -> [..., nb, bs] K rows of their positions (see AttentionBatch)."""
        bs = self.block_size
        return block_ids[..., None] * (2 * bs) + torch.arange(bs, device=self.device)

    def _long(self, values: Seq[int] | Seq[Seq[int]]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

"""Model runner: turns a `BatchPlan` into tensors, runs one forward, returns sampling logits.

Mechanism only (torch). The block tables come from the block manager; the runner computes each
token's slot (block id, offset) from its position:

  position p of a sequence  ->  block block_ids[p // block_size], offset p % block_size
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from kvcake.engine.batcher import BatchPlan
from kvcake.engine.kv_pool import KVPool
from kvcake.engine.model import AttentionBatch, LlamaModel
from kvcake.engine.sequence import Sequence
from kvcake.types import BlockId


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.block_size = pool.block_size

    def run(self, plan: BatchPlan, seqs: Mapping[str, Sequence],
            tables: Mapping[str, list[BlockId]],
            layer_hook: Callable[[int], None] | None = None, all_rows: bool = False) -> Tensor:
        """Logits [num sampling chunks, vocab] in the order of the sampling chunks of `plan`
        (with `all_rows`, logits of every scheduled token instead)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        k_slots: list[int] = []
        logit_rows: list[int] = []
        prefill: list[tuple[int, int, int, Tensor | None]] = []
        decode_rows: list[int] = []
        decode_tables: list[list[BlockId]] = []
        decode_lens: list[int] = []
        for chunk in plan.chunks:
            seq, table = seqs[chunk.request_id], tables[chunk.request_id]
            row = len(input_ids)
            end = chunk.start + chunk.num_tokens
            input_ids.extend(seq.token_ids[chunk.start:end])
            pos = range(chunk.start, end)
            positions.extend(pos)
            # Layer rows are [block][K|V][offset]: K of position p sits at b*2*bs + p%bs.
            k_slots.extend(table[p // bs] * 2 * bs + p % bs for p in pos)
            num_ctx_blocks = -(-end // bs)
            if chunk.num_tokens == 1 and chunk.start > 0:
                decode_rows.append(row)
                decode_tables.append(table[:num_ctx_blocks])
                decode_lens.append(end)
            else:
                k_rows = None if chunk.start == 0 else \
                    self._k_rows(self._long(table[:num_ctx_blocks])).flatten()[:end]
                prefill.append((row, chunk.num_tokens, end, k_rows))
            if all_rows:
                logit_rows.extend(range(row, row + chunk.num_tokens))
            elif chunk.samples:
                logit_rows.append(row + chunk.num_tokens - 1)
        batch = AttentionBatch(
            prefill=prefill,
            decode_rows=None, decode_k_rows=None, decode_mask=None,
            k_slots=(k := self._long(k_slots)), v_slots=k + bs, block_size=bs)
        if decode_rows:
            self._fill_decode(batch, decode_rows, decode_tables, decode_lens)
        return self.model(self._long(input_ids), self._long(positions), batch, self.pool,
                          self._long(logit_rows), layer_hook)

    def _fill_decode(self, batch: AttentionBatch, rows: list[int],
                     tables: list[list[BlockId]], lens: list[int]) -> None:
        max_blocks = max(len(t) for t in tables)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in tables]
        batch.decode_rows = self._long(rows)
        batch.decode_k_rows = self._k_rows(self._long(padded)).flatten(-2)
        ctx = torch.arange(max_blocks * self.block_size, device=self.device)
        batch.decode_mask = (ctx[None, :] < self._long(lens)[:, None])[:, None, None, :]

    def _k_rows(self, block_ids: Tensor) -> Tensor:
        """[..., nb] block ids -> [..., nb, bs] K rows of their positions (see AttentionBatch)."""
        bs = self.block_size
        return block_ids[..., None] * (2 * bs) + torch.arange(bs, device=self.device)

    def _long(self, values: Seq[int] | Seq[Seq[int]]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

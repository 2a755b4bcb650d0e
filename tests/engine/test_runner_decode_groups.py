"""Decode batches are attended in groups of similar context length; results never change."""

from __future__ import annotations

import torch

from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.model import AttentionBatch
from kvcake.engine.sampling import SamplingParams
from kvcake.types import BlockId

from .conftest import SMALL_POOL

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _batch() -> AttentionBatch:
    empty = torch.empty(0, dtype=torch.long)
    return AttentionBatch(prefill=[], decode=[], k_slots=empty, v_slots=empty, block_size=16)


def _tables(num_blocks: list[int]) -> list[list[BlockId]]:
    return [[BlockId(10 * i + j) for j in range(n)] for i, n in enumerate(num_blocks)]


def test_spread_lengths_split_at_the_median_into_two_padded_groups() -> None:
    runner = Engine("tiny", SMALL_POOL).runner
    lens = [100, 20, 30, 90, 40, 95, 25, 110]
    blocks = [-(-n // 16) for n in lens]  # 7 2 2 6 3 6 2 7
    batch = _batch()
    runner._fill_decode(batch, [10, 11, 12, 13, 14, 15, 16, 17], _tables(blocks), lens)
    assert [g[0].tolist() for g in batch.decode] == [[11, 16, 12, 14], [13, 15, 10, 17]]
    (_, short_rows, short_mask), (_, long_rows, long_mask) = batch.decode
    assert short_rows.shape == (4, 3 * 16) and long_rows.shape == (4, 7 * 16)
    assert short_mask.shape == (4, 1, 1, 48)
    assert short_mask[:, 0, 0].sum(-1).tolist() == [20, 25, 30, 40]
    assert short_rows[0, :2].tolist() == [10 * 1 * 32, 10 * 1 * 32 + 1]  # block 10, K rows
    assert long_mask[:, 0, 0].sum(-1).tolist() == [90, 95, 100, 110]


def test_similar_lengths_or_small_batches_stay_one_group() -> None:
    runner = Engine("tiny", SMALL_POOL).runner
    similar = _batch()
    runner._fill_decode(similar, list(range(8)), _tables([6] * 7 + [7]), [90] * 7 + [100])
    small = _batch()
    runner._fill_decode(small, list(range(6)), _tables([1, 1, 1, 7, 7, 7]),
                        [10, 10, 10, 100, 100, 100])
    assert len(similar.decode) == 1 and len(small.decode) == 1
    assert small.decode[0][1].shape == (6, 7 * 16)


def test_grouped_decode_equals_each_sequence_alone() -> None:
    prompts = [[int(x) for x in torch.randint(0, 256, (n,), generator=torch.Generator()
                                              .manual_seed(n))] for n in
               (5, 120, 9, 100, 17, 90, 3, 70)]
    together = LLM("tiny", SMALL_POOL).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, together, strict=True):
        assert LLM("tiny", SMALL_POOL).generate([prompt], GREEDY)[0].token_ids == out.token_ids

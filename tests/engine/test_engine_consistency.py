"""Prefix cache, chunking and batching change how KV is computed, never the result."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.sampling import SamplingParams

from .conftest import SMALL_POOL

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("prompt_len", [64, 70])  # block-aligned (4 blocks) and unaligned
def test_cached_prefix_equals_cold_prefill(prompt_len: int) -> None:
    prompt = _ids(prompt_len, 1)
    warm = LLM("tiny", SMALL_POOL)
    [first] = warm.generate([prompt[:50] + _ids(10, 2)], GREEDY)  # shares 3 full blocks
    assert first.num_cached_tokens == 0
    [hot] = warm.generate([prompt], GREEDY)
    cold = LLM("tiny", dataclasses.replace(SMALL_POOL, enable_prefix_caching=False))
    [ref] = cold.generate([prompt], GREEDY)
    assert hot.num_cached_tokens == 48 and ref.num_cached_tokens == 0
    assert hot.token_ids == ref.token_ids
    cached, hot_logits = warm.engine.prompt_logits(prompt)
    _, ref_logits = cold.engine.prompt_logits(prompt)
    # The second generate cached every full block of `prompt`; one token is always recomputed.
    assert cached == (prompt_len - 1) // 16 * 16
    assert (hot_logits[-1] - ref_logits[-1]).abs().max().item() < 1e-5


def test_fully_cached_prompt_recomputes_last_block() -> None:
    llm = LLM("tiny", SMALL_POOL)
    prompt = _ids(32, 4)
    [a] = llm.generate([prompt], GREEDY)
    [b] = llm.generate([prompt], GREEDY)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 16)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("budget", [7, 33])
def test_chunked_prefill_equals_unchunked(budget: int) -> None:
    prompt = _ids(90, 5)
    chunked = Engine("tiny", dataclasses.replace(SMALL_POOL, max_num_batched_tokens=budget))
    whole = Engine("tiny", SMALL_POOL)
    _, a = chunked.prompt_logits(prompt)
    _, b = whole.prompt_logits(prompt)
    assert (a - b).abs().max().item() < 1e-5
    for e in (chunked, whole):
        e.add_request("r", prompt, GREEDY)
    outs = [_drain(chunked)["r"], _drain(whole)["r"]]
    assert outs[0] == outs[1] and len(outs[0]) == GREEDY.max_tokens


def test_batched_decode_equals_each_alone() -> None:
    prompts = [_ids(n, 10 + n) for n in (3, 17, 40, 64, 95, 1)]
    solo = LLM("tiny", dataclasses.replace(SMALL_POOL, enable_prefix_caching=False))
    alone = [solo.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = LLM("tiny", SMALL_POOL).generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == alone


def test_requests_join_while_others_decode() -> None:
    engine = Engine("tiny", dataclasses.replace(SMALL_POOL, max_num_batched_tokens=24))
    a, b = _ids(20, 21), _ids(50, 22)
    engine.add_request("a", a, GREEDY)
    first = engine.step()
    assert [o.request_id for o in first] == ["a"]
    engine.add_request("b", b, GREEDY)
    # b's 50-token prompt is prefilled in chunks (23 + 23 + 4 tokens next to a's decode token).
    got = {"a": list(first[0].new_token_ids), "b": []}
    steps = []
    for _ in range(3):
        outs = engine.step()
        steps.append([o.request_id for o in outs])
        for o in outs:
            got[o.request_id] += o.new_token_ids
    assert steps == [["a"], ["a"], ["a", "b"]]
    for rid, ids in _drain(engine).items():
        got[rid] += ids
    ref = LLM("tiny", SMALL_POOL).generate([a, b], GREEDY)
    assert [got["a"], got["b"]] == [o.token_ids for o in ref]
    assert len(got["b"]) == GREEDY.max_tokens


def test_preemption_under_block_pressure_keeps_results() -> None:
    # 12 blocks of 16 tokens: four 40-token prompts cannot all grow to 52 tokens at once.
    tight = Engine("tiny", dataclasses.replace(SMALL_POOL, num_blocks=12))
    prompts = [_ids(40, 30 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        tight.add_request(f"r{i}", p, GREEDY)
    got = _drain(tight)
    ref = LLM("tiny", SMALL_POOL).generate(prompts, GREEDY)
    assert [got[f"r{i}"] for i in range(4)] == [o.token_ids for o in ref]


def _drain(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out

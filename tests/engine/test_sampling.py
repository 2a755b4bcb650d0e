"""Sampler: greedy, temperature, top-k, top-p, seeds, stop tokens, max_tokens."""

from __future__ import annotations

import torch

from kvcake.engine.llm import LLM
from kvcake.engine.sampling import Sampler, SamplingParams

from .conftest import SMALL_POOL

LOGITS = torch.tensor([[0.0, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.9]])


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    s = Sampler()
    for p in (SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)):
        for i in range(20):
            assert s.sample(LOGITS, [f"a{i}", f"b{i}"], [p, p]) == [1, 0]


def test_top_k_2_never_samples_outside_top_two() -> None:
    s = Sampler()
    p = SamplingParams(temperature=10.0, top_k=2, seed=1)
    seen = {tuple(s.sample(LOGITS, ["a", "b"], [p, p])) for _ in range(50)}
    assert {x for x, _ in seen} <= {1, 2} and {y for _, y in seen} <= {0, 3}
    assert len({x for x, _ in seen}) == 2  # both candidates do occur


def test_seed_makes_sampling_reproducible_and_batch_independent() -> None:
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    prompt = [5, 6, 7]
    alone = LLM("tiny", SMALL_POOL).generate([prompt], p)[0].token_ids
    batched = LLM("tiny", SMALL_POOL).generate(
        [[9, 9, 9, 9], prompt], [SamplingParams(temperature=1.0, seed=7, max_tokens=10), p])
    assert batched[1].token_ids == alone
    other = LLM("tiny", SMALL_POOL).generate([prompt], SamplingParams(
        temperature=1.0, seed=43, max_tokens=10, ignore_eos=True))[0].token_ids
    assert other != alone


def test_stop_token_ids_and_max_tokens() -> None:
    llm = LLM("tiny", SMALL_POOL)
    greedy = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    stop = greedy.token_ids[2]
    first = greedy.token_ids.index(stop)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: first + 1]

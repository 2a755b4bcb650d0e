"""Prompt log probabilities (echo + logprobs): the engine scores every prompt token after the
first from its own forward pass, in chunks, without reusing a cached prefix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcake.engine.engine import Engine, RequestOutput
from kvcake.engine.sampling import SamplingParams

from .conftest import SMALL_POOL

# Chunks of 5 tokens, so a 13-token prompt spans three prefill steps.
CHUNKED = dataclasses.replace(SMALL_POOL, max_num_batched_tokens=5, block_size=4)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]


def _run(engine: Engine, rid: str, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(rid, PROMPT, params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


def _expected() -> torch.Tensor:
    _, logits = Engine("tiny", SMALL_POOL).prompt_logits(PROMPT)
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_match_a_full_forward_pass() -> None:
    engine = Engine("tiny", CHUNKED)
    _run(engine, "warm", SamplingParams(max_tokens=1))  # the prompt's blocks are now cached
    outs = _run(engine, "r", SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True))
    first = outs[0]
    assert first.num_cached_tokens == 0  # the cached prefix was recomputed: it has no logits
    lp = first.prompt_logprobs
    assert lp is not None and len(lp) == len(PROMPT) and lp[0] is None
    expected = _expected()
    for i in range(1, len(PROMPT)):
        entry = lp[i]
        assert entry is not None
        token, value, top = entry
        assert token == PROMPT[i]
        assert value == pytest.approx(float(expected[i - 1, token]), abs=1e-3)
        assert len(top) == 2
        best = torch.topk(expected[i - 1], 2)
        assert top[0][1] == pytest.approx(float(best.values[0]), abs=1e-3)
        assert top[0][1] >= top[1][1]
    assert all(o.prompt_logprobs is None for o in outs[1:])  # only with the first token


def test_requests_without_prompt_logprobs_get_none_and_reuse_the_cache() -> None:
    engine = Engine("tiny", CHUNKED)
    _run(engine, "warm", SamplingParams(max_tokens=1))
    outs = _run(engine, "r", SamplingParams(max_tokens=2, logprobs=1, ignore_eos=True))
    assert outs[0].num_cached_tokens > 0
    assert all(o.prompt_logprobs is None for o in outs)
    assert all(o.logprobs is not None for o in outs)


def test_prompt_logprobs_zero_top_and_bad_values() -> None:
    engine = Engine("tiny", CHUNKED)
    outs = _run(engine, "r", SamplingParams(max_tokens=1, prompt_logprobs=0))
    lp = outs[0].prompt_logprobs
    assert lp is not None and all(e is not None and e[2] == [] for e in lp[1:])
    for bad in (-1, 21, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_a_request_preempted_mid_prompt_reports_each_token_once() -> None:
    # 5 blocks of 4, chunks of 3: "a" grows until the newest request ("b", mid-prompt) is
    # preempted; "b" is re-admitted, recomputes its prompt, and reports each token once.
    engine = Engine("tiny", dataclasses.replace(CHUNKED, num_blocks=5, max_num_batched_tokens=3))
    engine.add_request("a", [10, 11], SamplingParams(max_tokens=18, ignore_eos=True))
    engine.step()
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1,
                                                   ignore_eos=True))
    preempted_before_output, outs = False, []
    schedule = engine.batcher.schedule

    def watched():  # type: ignore[no-untyped-def]
        plan = schedule()
        nonlocal preempted_before_output
        preempted_before_output |= "b" in plan.preempted_ids and not outs
        return plan

    engine.batcher.schedule = watched  # type: ignore[method-assign]
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == "b")
    assert preempted_before_output  # the case under test happened
    assert [o.prompt_logprobs is not None for o in outs] == [True, False]
    lp = outs[0].prompt_logprobs
    assert lp is not None and len(lp) == len(PROMPT)
    expected = _expected()
    for i in range(1, len(PROMPT)):
        entry = lp[i]
        assert entry is not None and entry[0] == PROMPT[i]
        assert entry[1] == pytest.approx(float(expected[i - 1, PROMPT[i]]), abs=1e-3)

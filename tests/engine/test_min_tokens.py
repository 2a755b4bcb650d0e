"""min_tokens (vLLM semantics): stop ids and EOS are masked until that many tokens exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcake.engine.config import PRESETS
from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.sampling import SamplingParams, suppress_tokens

from .conftest import SMALL_POOL, make_hf_dir

PROMPT = [1, 2, 3]


def _reference(engine: Engine, prompt: list[int], params: SamplingParams,
               banned: tuple[int, ...]) -> list[int]:
    """Greedy decoding by full re-scoring (prompt_logits), masking `banned` while short."""
    ids, out = list(prompt), list[int]()
    while len(out) < params.max_tokens:
        row = engine.prompt_logits(ids)[1][-1].clone()
        if len(out) < params.min_tokens:
            row[list(banned)] = float("-inf")
        out.append(int(row.argmax()))
        ids.append(out[-1])
        if out[-1] in banned:
            break
    return out


def test_min_tokens_suppresses_stop_token_ids_then_allows_them() -> None:
    llm = LLM("tiny", SMALL_POOL)
    first = llm.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids[0]
    stop_now = SamplingParams(max_tokens=8, stop_token_ids=(first,), ignore_eos=True)
    assert llm.generate([PROMPT], stop_now)[0].token_ids == [first]
    for min_tokens in (1, 3, 8):
        params = SamplingParams(max_tokens=8, stop_token_ids=(first,), ignore_eos=True,
                                min_tokens=min_tokens)
        out = llm.generate([PROMPT], params)[0]
        expected = _reference(Engine("tiny", SMALL_POOL), PROMPT, params, (first,))
        assert out.token_ids == expected
        assert first not in out.token_ids[:min_tokens]
        assert len(out.token_ids) >= min_tokens
        assert out.finish_reason == ("stop" if expected[-1] == first else "length")


def test_min_tokens_suppresses_eos_unless_ignore_eos(tmp_path: Path) -> None:
    path = make_hf_dir(tmp_path, PRESETS["tiny"])
    greedy = LLM(str(path), SMALL_POOL).generate(
        [PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    eos = greedy[1]  # make the model's second greedy token its EOS
    raw = json.loads((path / "config.json").read_text())
    raw["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(raw))
    llm = LLM(str(path), SMALL_POOL)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=6))[0].token_ids == greedy[:2]
    params = SamplingParams(max_tokens=6, min_tokens=4)
    out = llm.generate([PROMPT], params)[0].token_ids
    assert out == _reference(Engine(str(path), SMALL_POOL), PROMPT, params, (eos,))
    assert eos not in out[:4] and out[:1] == greedy[:1]
    # ignore_eos: EOS neither stops nor is masked, so min_tokens changes nothing.
    ignore = SamplingParams(max_tokens=6, min_tokens=4, ignore_eos=True)
    assert llm.generate([PROMPT], ignore)[0].token_ids == greedy


@pytest.mark.parametrize("min_tokens", [-1, 9, 2.0, True])
def test_min_tokens_out_of_range_is_a_clear_error(min_tokens: object) -> None:
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=8\]"):
        SamplingParams(max_tokens=8, min_tokens=min_tokens)  # type: ignore[arg-type]
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8


def test_suppress_tokens_masks_only_named_rows_and_skips_out_of_vocab_ids() -> None:
    logits = torch.zeros(3, 4)
    suppress_tokens(logits, [0, 2], [(1, 3, 99), (0,)])
    inf = float("-inf")
    assert logits.tolist() == [[0, inf, 0, inf], [0, 0, 0, 0], [inf, 0, 0, 0]]

"""`kvcake generate` prints one JSON object with the generated ids, TTFT and cached tokens."""

from __future__ import annotations

import json

import pytest

from kvcake.engine.llm import LLM
from kvcake.engine.sampling import SamplingParams


def test_generate_prompt_ids_json(capsys: pytest.CaptureFixture, kvcake_main) -> None:
    assert kvcake_main(["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "5",
                 "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = LLM("tiny", device="cpu").generate([[1, 2, 3]], SamplingParams(max_tokens=5))[0]
    assert out["token_ids"] == expected.token_ids
    assert out["prompt_token_ids"] == [1, 2, 3]
    assert out["cached_tokens"] == 0 and out["ttft_s"] >= 0
    assert out["finish_reason"] in ("length", "stop")


def test_generate_text_prompt(capsys: pytest.CaptureFixture, kvcake_main) -> None:
    assert kvcake_main(["generate", "--prompt", "The KVCache is", "--max-tokens", "3", "--json",
                 "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"][:3] == [256, ord("T"), ord("h")]
    assert len(out["token_ids"]) <= 3

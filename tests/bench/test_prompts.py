"""Prompts from trace records: real prefix sharing, exact lengths, tokens in range."""

from __future__ import annotations

import pytest

from kvcake.bench.prompts import PromptBuilder, safe_token_range


def test_equal_hash_ids_give_equal_blocks_and_different_ids_differ() -> None:
    builder = PromptBuilder(vocab_size=512, seed=3)
    a = builder.build([0, 1, 2], 1536, request_index=0)
    b = builder.build([0, 1, 9], 1536, request_index=1)
    assert a[:1024] == b[:1024]  # shared prefix: hash ids 0 and 1
    assert a[1024:] != b[1024:]
    assert builder.block(5) == PromptBuilder(vocab_size=512, seed=3).block(5)  # deterministic
    assert builder.block(5) != PromptBuilder(vocab_size=512, seed=4).block(5)  # seeded


def test_lengths_with_scaling() -> None:
    builder = PromptBuilder(vocab_size=512, scale_tokens=0.25)
    assert builder.block_len == 128
    prompt = builder.build([0, 1, 2, 3], 1700, request_index=0)
    assert len(prompt) == 425  # round(1700 * 0.25): the last block truncated
    assert prompt[:128] == builder.block(0)
    assert prompt[384:] == builder.block(3)[:41]
    assert builder.scaled_len(3) == 1  # never zero
    assert len(PromptBuilder(scale_tokens=0.001).build([7], 512, 0)) == 1


def test_missing_hash_ids_are_filled_with_private_blocks() -> None:
    builder = PromptBuilder(vocab_size=512, scale_tokens=1 / 64)  # 8-token blocks
    a = builder.build([1], 1536, request_index=0)  # 24 tokens after scaling
    b = builder.build([1], 1536, request_index=1)
    assert len(a) == len(b) == 24
    assert a[:8] == b[:8] and a[8:] != b[8:]


def test_tokens_stay_in_the_safe_range() -> None:
    assert safe_token_range(512) == (0, 256)  # the presets' BOS/EOS (256, 257) are excluded
    assert safe_token_range(128256) == (0, 128000)  # Llama 3's special tokens are excluded
    prompt = PromptBuilder(vocab_size=512).build(list(range(20)), 10240, 0)
    assert 0 <= min(prompt) and max(prompt) < 256


def test_bad_settings_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--scale-tokens"):
        PromptBuilder(scale_tokens=0)
    with pytest.raises(ValueError, match="vocab_size"):
        PromptBuilder(vocab_size=1)

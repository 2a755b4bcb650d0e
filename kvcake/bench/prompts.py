"""Token-id prompts from Mooncake trace records, with real prefix sharing.

A Mooncake trace gives each request `hash_ids`, one per 512-token block of its prompt: two
requests that share a hash id at position i share that whole block *and everything before it*.
`PromptBuilder` turns hash ids into tokens so that the server sees exactly that sharing:
block i of a prompt is a pseudo-random token sequence seeded only by (seed, hash_id), so equal
hash ids give equal blocks and different ids give (with overwhelming probability) different
ones. `scale_tokens` shrinks every block and every prompt by the same factor, so a trace made for
a 70B cluster fits a small model's context while keeping its sharing structure.

Token ids are drawn from a "safe" range of the vocabulary: the top ids are skipped because
models put their special tokens there (Llama 3: 128000+; our presets: 256 and 257).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TRACE_BLOCK_SIZE = 512  # tokens per hash id in the published Mooncake traces
DEFAULT_VOCAB_SIZE = 32000  # the smallest common Llama vocabulary: safe when the server won't say


def safe_token_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of the token ids prompts use: the top min(256, vocab/2) ids are skipped."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return 0, vocab_size - min(256, vocab_size // 2)


@dataclass(frozen=True)
class PromptBuilder:
    vocab_size: int = DEFAULT_VOCAB_SIZE
    scale_tokens: float = 1.0
    seed: int = 0
    trace_block_size: int = TRACE_BLOCK_SIZE

    def __post_init__(self) -> None:
        if not self.scale_tokens > 0:
            raise ValueError(f"--scale-tokens must be > 0, got {self.scale_tokens}")
        if self.trace_block_size < 1:
            raise ValueError(f"trace_block_size must be >= 1, got {self.trace_block_size}")
        safe_token_range(self.vocab_size)

    @property
    def block_len(self) -> int:
        """Tokens per hash block after scaling (at least 1)."""
        return max(1, round(self.trace_block_size * self.scale_tokens))

    def scaled_len(self, num_tokens: int) -> int:
        """A trace length (input or output) after scaling; at least 1."""
        return max(1, round(num_tokens * self.scale_tokens))

    def block(self, hash_id: int) -> list[int]:
        """The tokens of the block named `hash_id`: a function of (seed, hash_id) only."""
        low, high = safe_token_range(self.vocab_size)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0, int(hash_id) & (2**63 - 1)]))
        return rng.integers(low, high, size=self.block_len).tolist()

    def build(self, hash_ids: Sequence[int], input_length: int, request_index: int) -> list[int]:
        """The prompt of one trace record: its blocks, cut to the scaled input length.

        When the record's hash ids cover fewer tokens than its length (malformed or truncated
        records), the rest is filled with blocks private to this request (seeded by its index),
        so they are never shared by accident.
        """
        target = self.scaled_len(input_length)
        tokens: list[int] = []
        for hash_id in hash_ids:
            if len(tokens) >= target:
                break
            tokens.extend(self.block(hash_id))
        filler = 0
        while len(tokens) < target:
            low, high = safe_token_range(self.vocab_size)
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, request_index,
                                                                filler]))
            tokens.extend(rng.integers(low, high, size=self.block_len).tolist())
            filler += 1
        return tokens[:target]

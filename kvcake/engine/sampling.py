"""Sampling parameters and the sampler.

`SamplingParams` is greedy by default (temperature 0), so offline runs are reproducible; the
OpenAI-compatible server passes its own defaults explicitly. Seeded requests draw from their
own generator, so their tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None  # None: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # True: the model's EOS does not stop generation

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None (no cut), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, "
                             f"got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Turns one row of logits per sequence into one token id per sequence."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        greedy_ids = logits.argmax(dim=-1).tolist()
        if all(p.greedy for p in params):
            return greedy_ids
        out: list[int] = []
        for row, rid, p, greedy_id in zip(logits, request_ids, params, greedy_ids, strict=True):
            out.append(greedy_id if p.greedy else self._sample_row(row, rid, p))
        return out

    def _sample_row(self, row: Tensor, request_id: str, p: SamplingParams) -> int:
        row = row.float() / p.temperature
        if p.top_k is not None and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = self._generator(request_id, p, row.device)
        return int(torch.multinomial(probs, 1, generator=gen).item())

    def _generator(self, request_id: str, p: SamplingParams,
                   device: torch.device) -> torch.Generator | None:
        if p.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(p.seed)
            self._generators[request_id] = gen
        return gen

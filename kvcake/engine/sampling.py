"""Sampling parameters and the sampler.

`SamplingParams` is greedy by default (temperature 0), so offline runs are reproducible; the
OpenAI-compatible server passes its own defaults explicitly. Seeded requests draw from their
own generator, so their tokens do not depend on what else is in the batch.

Disaggregation: a seeded request samples its first token on the prefill instance and the rest
on a decode instance. `Sampler.export_state` captures its generator after the first draw and
`Sampler.import_state` resumes it elsewhere, so the tokens equal a colocated run's.

`min_tokens` (vLLM semantics): until that many tokens are generated, the logits of the stop
token ids (and of EOS unless `ignore_eos`) are masked to -inf (`suppress_tokens`), so they can
neither be sampled nor end the request early.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcake.engine import cpu_ops


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None  # None: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # True: the model's EOS does not stop generation
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    # vLLM's sampling extras (neutral defaults): a repeated token's logit is divided (if > 0) or
    # multiplied by repetition_penalty (prompt and output tokens); frequency / presence
    # penalties subtract count * f and (count > 0) * p (output tokens); min_p drops tokens whose
    # probability is below min_p times the top token's.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    # Log probabilities of each sampled token and of this many most likely ones (None: none),
    # from the logits the sampler sees (after penalties, before temperature and filters).
    logprobs: int | None = None
    # Log probabilities of every prompt token after the first (the first has none) and of this
    # many most likely ones, from the raw logits (None: none). A request that asks computes its
    # whole prompt: a cached prefix's logits are not kept, so its blocks are not reused.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= 20):
                raise ValueError(f"{name} must be an integer in [0, 20] or None, got {value!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got "
                             f"{self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}; lower min_tokens or raise max_tokens")
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

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def apply_penalties(logits: Tensor, row: int, prompt_ids: list[int], output_ids: list[int],
                    p: SamplingParams) -> None:
    """vLLM's repetition / frequency / presence penalties on one row of `logits`, in place."""
    vocab = logits.shape[-1]
    x = logits[row]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if t < vocab}),
                            dtype=torch.long, device=x.device)
        if seen.numel():
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                  vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor([t for t in output_ids if t < vocab],
                                             dtype=torch.long), minlength=vocab).to(x.device)
        x -= p.frequency_penalty * counts.to(x.dtype)
        x -= p.presence_penalty * (counts > 0).to(x.dtype)


TokenLogprob = tuple[int, float, list[tuple[int, float]]]  # token, its logprob, the top ones


def token_logprobs(rows: Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """`token_logprob` of each row of `rows` [n, vocab] and its token (one softmax for all)."""
    if not token_ids:
        return []
    logp = torch.log_softmax(rows.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if top:
        best = torch.topk(logp, top, dim=-1)
        tops = [list(zip(i, v, strict=True))
                for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
    else:
        tops = [[] for _ in token_ids]
    return list(zip(token_ids, chosen, tops, strict=True))


def token_logprob(row: Tensor, token_id: int, top: int) -> TokenLogprob:
    """The sampled token's log probability under `row` and the `top` most likely tokens'."""
    logp = torch.log_softmax(row.float(), dim=-1)
    best = torch.topk(logp, top) if top else None
    pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist(),
                                             strict=True))
    return token_id, float(logp[token_id]), pairs


def suppress_tokens(logits: Tensor, rows: list[int], token_ids: list[tuple[int, ...]]) -> None:
    """Mask (in place, to -inf) `token_ids[i]` in row `rows[i]` of `logits`; ids outside the
    vocabulary are skipped (a stop id may name a token the model never emits)."""
    vocab = logits.shape[-1]
    for row, ids in zip(rows, token_ids, strict=True):
        cols = [t for t in ids if t < vocab]
        if cols:
            logits[row, cols] = float("-inf")


def greedy_token_ids(logits: Tensor) -> list[int]:
    """Each row's argmax (the first largest logit) as a list; on CPU fp32 through kvcake's op
    (`cpu_ops`: one call, vectorized), else torch's argmax."""
    if logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] and cpu_ops.fused(logits):
        return cpu_ops.fused_ops().argmax_rows(logits)  # type: ignore[no-any-return]
    return logits.argmax(dim=-1).tolist()  # type: ignore[no-any-return]


class Sampler:
    """Turns one row of logits per sequence into one token id per sequence."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def export_state(self, request_id: str) -> bytes | None:
        """The request's generator state (opaque bytes), or None when it has no generator
        (unseeded or greedy: nothing to carry to another instance)."""
        gen = self._generators.get(request_id)
        return None if gen is None else bytes(gen.get_state().numpy().tobytes())

    def import_state(self, request_id: str, p: SamplingParams, state: bytes,
                     device: torch.device) -> None:
        """Resume `request_id`'s seeded generator from `export_state` bytes of another sampler.
        ValueError (nothing changed) for an unseeded request or bytes that are not a state."""
        if p.seed is None:
            raise ValueError("sampler_state: only seeded requests carry a sampler state; "
                             "pass a seed in the sampling params or omit sampler_state")
        gen = torch.Generator(device=device)
        try:
            gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"sampler_state: {len(state)} bytes are not a generator state of "
                             f"this device ({device}); pass Engine.sampler_state() bytes "
                             f"from an engine on the same kind of device") from None
        self._generators[request_id] = gen

    def sample(self, logits: Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        greedy_ids = greedy_token_ids(logits)
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
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
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

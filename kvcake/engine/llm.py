"""`kvcake.LLM`: offline batch generation on one engine instance.

    llm = LLM(model="tiny")
    [out] = llm.generate("The KVCache is", SamplingParams(max_tokens=16))
    out.token_ids, out.ttft_s, out.num_cached_tokens

All prompts of one `generate` call are queued together and run with continuous batching; the
prefix cache persists across calls, so a repeated prefix is not recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcake.clock import Clock
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.sampling import SamplingParams
from kvcake.ids import CountingIds

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str | None  # None when the model has no tokenizer
    finish_reason: str
    num_cached_tokens: int
    ttft_s: float  # from the request's arrival to its first token


class LLM:
    def __init__(self, model: str = "tiny", config: EngineConfig | None = None,
                 clock: Clock | None = None, **engine_options: Any) -> None:
        """`engine_options` are EngineConfig fields (e.g. dtype="bfloat16", block_size=32);
        unknown names raise ValueError."""
        if config is not None and engine_options:
            raise ValueError("LLM: pass either config or engine options, not both")
        self.engine = Engine(model, config or EngineConfig.from_dict(engine_options), clock)
        self._ids = CountingIds("llm")

    def encode(self, text: str) -> list[int]:
        if self.engine.tokenizer is None:
            raise ValueError("prompt: this model directory has no tokenizer.json; "
                             "pass token ids instead of text")
        return self.engine.tokenizer.encode(text)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """One output per prompt, in order. A prompt is text or a list of token ids."""
        batch = _as_batch(prompts)
        params = _as_params(sampling_params, len(batch))
        token_lists = [self.encode(p) if isinstance(p, str) else list(p) for p in batch]
        rids: list[str] = []
        try:
            for ids, p in zip(token_lists, params, strict=True):
                rid = self._ids.next_id()
                self.engine.add_request(rid, ids, p)
                rids.append(rid)
        except ValueError:
            for rid in rids:  # leave the engine as it was
                self.engine.abort(rid)
            raise
        outputs: dict[str, list[int]] = {rid: [] for rid in rids}
        final = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    final[out.request_id] = out
        results = []
        for rid, ids in zip(rids, token_lists, strict=True):
            out = final[rid]
            gen = outputs[rid]
            tok = self.engine.tokenizer
            results.append(CompletionOutput(
                prompt_token_ids=ids, token_ids=gen,
                text=tok.decode(gen) if tok is not None else None,
                finish_reason=out.finish_reason.value if out.finish_reason else "",
                num_cached_tokens=out.num_cached_tokens,
                ttft_s=(out.first_token_s or out.arrival_s) - out.arrival_s))
        return results


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if not items:
        raise ValueError("prompt: the prompt is empty; pass text or at least one token id")
    if all(isinstance(x, int) for x in items):
        return [items]  # one prompt of token ids
    return items


def _as_params(params: SamplingParams | Sequence[SamplingParams] | None,
               n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts; pass one or one "
                         "per prompt")
    return list(params)

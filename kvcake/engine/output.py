"""`RequestOutput`, what one `Engine.step()` reports for one request, and its assembly from the
request's sequence."""

from __future__ import annotations

from dataclasses import dataclass

from kvcake.engine.sampling import TokenLogprob
from kvcake.engine.sequence import FinishReason
from kvcake.engine.sequence import Sequence as Seq


@dataclass(frozen=True)
class RequestOutput:
    """What one step() produced for one request (only requests that sampled, or aborted)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None  # None while running
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    arrival_s: float
    first_token_s: float | None  # clock time of the first token; None before it
    logprobs: list[TokenLogprob] | None = None  # per new token, when the request asks
    # With the first token of a request whose params ask for prompt_logprobs: one per prompt
    # token, None for the first (nothing predicts it); None otherwise.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_scheduled_s: float | None = None  # clock time of the step that first scheduled it


def request_output(seq: Seq, new_ids: list[int], logprobs: list[TokenLogprob] | None = None,
                   prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
    """`seq`'s output of this step: `new_ids` and their log probabilities, its state now."""
    return RequestOutput(logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        request_id=seq.request_id, new_token_ids=new_ids,
        finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens or 0,
        arrival_s=seq.arrival_s, first_token_s=seq.first_token_s,
        first_scheduled_s=seq.first_scheduled_s)

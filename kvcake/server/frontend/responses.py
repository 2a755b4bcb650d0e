"""The OpenAI response bodies the API sends back: whole responses, stream chunks, errors, usage,
and the `logprobs` objects of completions and chats.

Every body and chunk of one response carries the same `ResponseHead` (id, creation time,
model). Plain dicts out, ready for `json.dumps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcake.server.frontend.backend import FinishReason


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one response repeats: its `id`, `created` (Unix seconds)
    and the `model` that answers."""

    request_id: str
    created: int
    model: str


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    kinds = {404: "not_found_error", 429: "rate_limit_error"}
    kind = kinds.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int,
          num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def completion_body(head: ResponseHead, text: str, finish_reason: FinishReason | None,
                    usage_: dict[str, Any] | None,
                    token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """A /v1/completions response (with usage) or stream chunk (usage None)."""
    choice = _choice("text", text, finish_reason, token_ids)
    return _body(head, "text_completion", choice, usage_)


def chat_body(head: ResponseHead, text: str, finish_reason: FinishReason | None,
              usage_: dict[str, Any], token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """A non-streaming /v1/chat/completions response."""
    message = {"role": "assistant", "content": text}
    return _body(head, "chat.completion", _choice("message", message, finish_reason, token_ids),
                 usage_)


def chat_chunk(head: ResponseHead, text: str, finish_reason: FinishReason | None, first: bool,
               token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """One /v1/chat/completions stream chunk; the first one also carries the role."""
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    return _body(head, "chat.completion.chunk", _choice("delta", delta, finish_reason, token_ids),
                 None)


def usage_chunk(object_name: str, head: ResponseHead, usage_: dict[str, Any]) -> dict[str, Any]:
    """The final stream chunk when `stream_options.include_usage` is set: no choices."""
    return {"id": head.request_id, "object": object_name, "created": head.created,
            "model": head.model, "choices": [], "usage": usage_}


def _choice(content_key: str, content: Any, finish_reason: FinishReason | None,
            token_ids: Sequence[int] | None) -> dict[str, Any]:
    """The one choice of a body or chunk: its content under `content_key` ("text", "message"
    or "delta"), then logprobs, the finish reason and, if asked, the token ids."""
    choice: dict[str, Any] = {"index": 0, content_key: content, "logprobs": None,
                              "finish_reason": _reason(finish_reason)}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def _body(head: ResponseHead, object_name: str, choice: dict[str, Any],
          usage_: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": head.request_id, "object": object_name, "created": head.created,
            "model": head.model, "choices": [choice], "usage": usage_}


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


# ---- logprobs ----------------------------------------------------------------------------------


def completion_logprobs(entries: Sequence[Any], decode: Any,
                        offset: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object for generated tokens (and, with echo, the
    prompt's first); text offsets from `offset` (the length of the text before them). An
    entry's logprob and top may be None (the first prompt token: nothing predicts it)."""
    tokens, offsets = [], []
    for token, _lp, _top in entries:
        offsets.append(offset)
        text = decode([token])
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _t, lp, _top in entries],
            "top_logprobs": [_top_map(top, decode) for _t, _lp, top in entries],
            "text_offset": offsets}


def prompt_entries(token_ids: Sequence[int], logprobs: Sequence[Any]) -> list[Any]:
    """The prompt's (token, logprob, top) entries for `completion_logprobs` from the engine's
    prompt log probabilities (None for the first token: logprob and top None)."""
    return [(t, None, None) if entry is None else entry
            for t, entry in zip(token_ids, logprobs, strict=True)]


def _top_map(top: Sequence[tuple[int, float]] | None, decode: Any) -> dict[str, float] | None:
    """token text -> logprob, most likely first; tokens that decode alike keep the best."""
    if top is None:
        return None
    out: dict[str, float] = {}
    for token_id, value in top:
        out.setdefault(decode([token_id]), value)
    return out


def chat_logprobs(entries: Sequence[Any], decode: Any) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id: int, lp: float) -> dict[str, Any]:
        text = decode([token_id])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                        for t, lp, top in entries]}

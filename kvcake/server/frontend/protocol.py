"""OpenAI request models, their validation, and the backend request made from them (the
response bodies: responses.py).

Every request field OpenAI (or vLLM, for `top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`)
defines is either supported or accepted only at the value that means "off" (for example `n=1`,
`echo=false`, `logprobs=null`); anything else, and any field we do not know, is an
`InvalidRequest` (HTTP 400) that names the field and says what to change. Nothing is silently
ignored except opaque tags and service hints that change no output (`user`, `metadata`, `store`,
`service_tier`, `prompt_cache_key`, `safety_identifier`, `parallel_tool_calls` without tools).
`stop` strings are applied by the API on the streamed text (detokenizer.py); vLLM's sampling
extras (`repetition_penalty`, `min_p`) and the OpenAI penalties reach the engine's sampler.
Completions' `echo` with `logprobs` asks the engine for the prompt's log probabilities too (the
legacy `logprobs` object then covers prompt and output); `max_tokens: 0` needs `echo` (the prompt
alone: the engine still samples one token, which the API drops).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvcake.server.frontend.backend import GenerateRequest
from kvcake.types import RequestId


class InvalidRequest(ValueError):
    """A request the API answers with 400 (or `status`), with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


MAX_N = 16  # choices per request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM: -1 or 0 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # choices, each its own request sharing the prompt
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: choices carry `token_ids`
    # vLLM's sampling extras (clients send them through extra_body)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # Accepted only at their neutral value (checked in _reject_unsupported)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # OpenAI fields that change nothing here: opaque tags and service options
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text"]  # json_object / json_schema (structured output) are not implemented


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (the prompt, scored)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # OpenAI chat fields accepted at their neutral value only
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | None = None
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Literal[True] = True  # False is not implemented: a 400 naming it
    add_generation_prompt: Literal[True] = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


_RequestT = TypeVar("_RequestT", CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                    DetokenizeRequest)

_UNSUPPORTED_UNLESS = {  # field -> (value that means "off", what to send instead)
    "best_of": ((None, 1), "omit best_of or send 1"),
    "suffix": ((None, ""), "omit suffix"),
    "skip_special_tokens": ((True,), "omit it (special tokens are always skipped)"),
    "spaces_between_special_tokens": ((True,), "omit it"),
    "include_stop_str_in_output": ((False,), "omit it (stop strings are withheld)"),
    "prompt_logprobs": ((None,), "omit prompt_logprobs"),
    "truncate_prompt_tokens": ((None,), "omit it and send a prompt that fits"),
    "tools": ((None, []), "omit tools (tool calling is not implemented)"),
    "tool_choice": ((None, "none"), "omit tool_choice or send \"none\""),
    "functions": ((None, []), "omit functions"),
    "function_call": ((None, "none"), "omit function_call"),
    "audio": ((None,), "omit audio (text only)"),
    "prediction": ((None,), "omit prediction"),
    "reasoning_effort": ((None,), "omit reasoning_effort"),
    "web_search_options": ((None,), "omit web_search_options"),
    "verbosity": ((None,), "omit verbosity"),
    "service_tier": ((None, "auto", "default"), "omit service_tier"),
}

_FIELD_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list holding one of those",
    "messages": "must be a non-empty list of {role, content} objects",
    "max_tokens": "must be an integer >= 1 (or null for as many as fit)",
    "max_completion_tokens": "must be an integer >= 1",
    "temperature": "must be a number in [0, 2]",
    "top_p": "must be a number in (0, 1]",
    "top_k": "must be an integer >= 1, or 0 / -1 to disable",
    "min_tokens": "must be an integer >= 0",
    "n": "must be an integer in [1, 16]",
}


def parse_request(model: type[_RequestT], body: bytes) -> _RequestT:
    """Validate a JSON body into `model`. Raises InvalidRequest naming the first bad field."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid_from(exc) from None
    if isinstance(request, _SamplingFields):
        _reject_unsupported(request)
    return request


def _invalid_from(exc: ValidationError) -> InvalidRequest:
    error = exc.errors(include_url=False)[0]
    kind, loc = error["type"], error["loc"]
    field = str(loc[0]) if loc else None
    if kind == "json_invalid":
        return InvalidRequest(f"the request body is not valid JSON: {error['msg']}")
    if kind == "model_type" and not loc:
        return InvalidRequest("the request body must be a JSON object")
    if kind == "extra_forbidden":
        where = ".".join(str(part) for part in loc)
        return InvalidRequest(
            f"unknown field {where!r}: this server does not support it; remove it", param=where
        )
    if kind == "missing":
        return InvalidRequest(f"missing required field {field!r}", param=field)
    hint = _FIELD_HINTS.get(field or "")
    path = ".".join(str(part) for part in loc if not isinstance(part, str) or "[" not in part)
    detail = hint if hint is not None and len(loc) <= 2 else error["msg"]
    return InvalidRequest(f"{path}: {detail} (got {_short(error.get('input'))})", param=field)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _reject_unsupported(request: _SamplingFields) -> None:
    for field, (off, advice) in _UNSUPPORTED_UNLESS.items():
        value = getattr(request, field, off[0])
        if not any(value == v and type(value) is type(v) for v in off):
            raise InvalidRequest(f"{field}={_short(value)} is not supported: {advice}", field)
    if isinstance(request, CompletionRequest) and request.max_tokens == 0 and not request.echo:
        raise InvalidRequest("max_tokens: 0 is only allowed with echo=true (the prompt alone); "
                             "ask for at least 1 token or set echo", "max_tokens")
    if getattr(request, "top_logprobs", None) is not None and \
            not getattr(request, "logprobs", False):
        raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
    if request.logit_bias:
        raise InvalidRequest("logit_bias is not supported: omit it", "logit_bias")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")


def _logprobs_wanted(body: _SamplingFields) -> int | None:
    """How many top log probabilities per token the request asks for (None: none)."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def _prompt_logprobs_wanted(body: _SamplingFields) -> int | None:
    """Completions' echo with logprobs: the prompt's log probabilities too (None: not asked)."""
    if isinstance(body, CompletionRequest) and body.echo:
        return body.logprobs
    return None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's `stop` strings (empty ones mean nothing)."""
    if stop is None:
        return ()
    return tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s)


def prompt_token_ids(prompt: str | list[int] | list[str] | list[list[int]],
                     encode: Any) -> list[int]:
    """The token ids of a completions `prompt`; a list must hold exactly one prompt."""
    if isinstance(prompt, str):
        return list(encode(prompt))
    if not prompt:
        raise InvalidRequest("prompt: must not be empty", "prompt")
    first = prompt[0]
    if isinstance(first, int):
        return list(prompt)  # type: ignore[arg-type]
    if len(prompt) != 1:
        raise InvalidRequest(
            f"prompt: a batch of {len(prompt)} prompts is not supported; send one per request",
            "prompt",
        )
    return list(encode(first)) if isinstance(first, str) else list(first)


def build_generate_request(request_id: RequestId, token_ids: Sequence[int],
                           body: _SamplingFields, max_tokens: int | None,
                           vocab_size: int, max_model_len: int) -> GenerateRequest:
    """Check `token_ids` and the length budget, and make the backend's request."""
    if not token_ids:
        raise InvalidRequest("prompt: must hold at least one token", "prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt"
        )
    bad_stop = next((t for t in body.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequest(
            f"stop_token_ids: {bad_stop} is outside the vocabulary [0, {vocab_size})",
            "stop_token_ids",
        )
    room = max_model_len - len(token_ids)
    if room < 1:
        raise InvalidRequest(
            f"prompt: {len(token_ids)} tokens leave no room to generate within the maximum "
            f"model length {max_model_len}; shorten the prompt", "prompt"
        )
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequest(
            f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
            f"the maximum model length {max_model_len}; ask for at most {room} tokens",
            "max_tokens",
        )
    limit = room if max_tokens is None else max_tokens
    if body.min_tokens > limit:
        raise InvalidRequest(f"min_tokens ({body.min_tokens}) exceeds max_tokens ({limit})",
                             "min_tokens")
    return GenerateRequest(
        # max_tokens 0 (echo): the engine samples one token, which the API drops
        request_id=request_id, prompt_token_ids=tuple(token_ids), max_tokens=max(limit, 1),
        temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        seed=body.seed, stop_token_ids=tuple(body.stop_token_ids),
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, min_p=body.min_p,
        logprobs=_logprobs_wanted(body), prompt_logprobs=_prompt_logprobs_wanted(body),
    )


def render_chat_text(messages: Sequence[tuple[str, str]]) -> str:
    """The built-in chat template: one `<|role|>` header line per message, then the reply's.

    Used for presets and model directories without a template of their own.
    """
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    return "".join(parts) + "<|assistant|>\n"

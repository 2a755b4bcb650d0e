"""The contract between the HTTP frontend and whatever generates tokens behind it.

The API (`kvcake/server/frontend/api.py`) validates and tokenizes a request, then awaits
`backend.generate(request)` and iterates over the `TokenStream` of `TokenEvent`s it returns.
Two backends fit this shape:
`LocalBackend` (one engine instance in-process: the colocated path) and the disaggregated
backend (the Conductor picks a prefill and a decode worker). The API never knows which.

Who calls what:
- `await generate(request)` is called once per HTTP request on the server's event loop and
  returns once the request is admitted. A backend that will not take the request now raises
  `Rejected` (before any compute is spent): the API answers 429 with `Retry-After`. A request
  the backend cannot serve as asked raises ValueError (the API answers 400 with its message).
  An exception raised while iterating the stream is a server error (500, or an error event in
  an SSE stream whose headers already went out).
- Events arrive in order; every event carries the token ids generated since the previous one
  (possibly several, never zero except on the final event). The last event has
  `finish_reason` set; nothing follows it.
- The API always calls `aclose()` on the stream when it is done with it, also after a client
  disconnect cancelled the task iterating it. `aclose()` before the final event aborts the
  request in the backend and frees its KV cache; it must not suspend (it may run in a
  cancelled task): hand slow cleanup to the backend's own thread or task. It is idempotent
  (the API may call it more than once) and a no-op after the final event.
- `encode`/`decode`/`chat_prompt` are cheap, thread-safe and never raise for valid text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from kvcake.types import RequestId


class FinishReason(StrEnum):
    """Why generation ended; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"  # an EOS or stop token was generated
    LENGTH = "length"  # max_tokens (or the model's length) was reached
    ABORT = "abort"  # the request was aborted (client gone, server shutting down)


@dataclass(frozen=True)
class GenerateRequest:
    """One validated generation request, already tokenized.

    Sampling fields follow vLLM's meaning: `temperature == 0` is greedy; `top_k == 0` and
    `top_p == 1` disable those filters; `seed` makes sampling reproducible per request;
    `min_tokens` suppresses EOS/stop tokens until that many tokens exist; `ignore_eos` lets
    generation run to `max_tokens`.
    """

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0  # vLLM's sampling extras (engine/sampling.py)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None  # top log probabilities per token (None: none)
    # top log probabilities per prompt token (None: no prompt log probabilities); a request
    # that asks computes its whole prompt (no prefix reuse)
    prompt_logprobs: int | None = None


# one generated token's (token id, log probability, [(id, log probability) of the top ones])
TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


def logprobs_of(raw: Sequence[Any] | None) -> tuple[TokenLogprob, ...] | None:
    """Log probabilities from an engine output or the wire, as a TokenEvent carries them."""
    if raw is None:
        return None
    return tuple((int(t), float(lp), tuple((int(i), float(v)) for i, v in top))
                 for t, lp, top in raw)


def prompt_logprobs_of(raw: Sequence[Any] | None) -> tuple[TokenLogprob | None, ...] | None:
    """Prompt log probabilities (None for the first token) from an engine output or the wire."""
    if raw is None:
        return None
    return tuple(None if entry is None else logprobs_of([entry])[0]  # type: ignore[index]
                 for entry in raw)


@dataclass(frozen=True)
class TokenEvent:
    """Tokens generated since the previous event of the same request.

    `num_cached_tokens` is how many prompt tokens were served from a prefix cache (local pages
    or the store) instead of being recomputed; it is final from the first event on.
    """

    token_ids: tuple[int, ...]
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked
    # with the first token, when asked: one per prompt token, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # with the first token, where the backend knows them (the in-process engine): seconds from
    # the engine's arrival to the step that first scheduled the request, and from that step's
    # start to the first token (vLLM's queue and prefill times)
    queue_s: float | None = None
    prefill_s: float | None = None


class TokenStream(Protocol):
    """The events of one admitted request (an async iterator that can be closed early)."""

    def __aiter__(self) -> TokenStream: ...

    async def __anext__(self) -> TokenEvent: ...

    async def aclose(self) -> None: ...


class QueueTokenStream:
    """A `TokenStream` fed through an asyncio queue by whoever runs the request.

    The producer puts `TokenEvent`s (the last one with a finish reason) or one exception that
    ends the stream. `aclose()` before the last event calls `abort(request_id)` once; it never
    suspends, because it may run in a task that is being cancelled (client disconnect).
    """

    def __init__(self, abort: Callable[[str], None], request_id: str,
                 sink: asyncio.Queue[TokenEvent | BaseException]) -> None:
        self._abort, self._request_id, self._sink = abort, request_id, sink
        self._done = False

    def __aiter__(self) -> QueueTokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._sink.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finish_reason is not None
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self._request_id)


class Rejected(Exception):
    """The backend will not take this request now. The API answers 429 with Retry-After."""

    def __init__(self, reason: str, retry_after_s: float, kind: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.kind = kind  # a metric label: the Conductor's reason, or max_waiting_requests


@dataclass(frozen=True)
class BackendStats:
    """Point-in-time load of a backend, exported as gauges on /metrics."""

    num_waiting_requests: int = 0  # admitted, not yet prefilled
    num_running_requests: int = 0  # prefilled, decoding
    kv_cache_usage: float = 0.0  # share of KV pages in use, 0..1
    transfer_bytes: int = 0  # KV bytes moved between instances/store (cumulative)
    extra: dict[str, float] = field(default_factory=dict)


class Backend(Protocol):
    """What the frontend needs from a token generator. See the module docstring for the rules."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + generated) one request may hold."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of a chat prompt from (role, content) pairs, ending where the reply starts."""
        ...

    async def generate(self, request: GenerateRequest) -> TokenStream:
        """Admit `request` and return its events; Rejected (429) or ValueError (400)."""
        ...

    def stats(self) -> BackendStats: ...

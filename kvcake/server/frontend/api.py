"""The OpenAI-compatible HTTP API over any `Backend`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with `stream: true`),
GET /v1/models, /health, /metrics. Errors use OpenAI's body `{"error": {message, type, param,
code}}`: 400 for invalid or unsupported input (nothing is silently ignored), 404 for an unknown
model, 413 for a body over `HttpLimits.max_request_bytes` (JSON nested deeper than
`max_json_depth` and text prompts longer than `max_prompt_chars` are 400s, refused before they
are parsed or tokenized: limits.py), 429 with `Retry-After` when the backend refuses a request,
500 for a backend failure.
Every error leaves the server serving. A client that disconnects (streaming or not) has its
request aborted in the backend.

A stream is `data: {chunk}` events, one per backend token event (its text may be empty while a
multi-byte character is incomplete), an optional usage chunk (`stream_options.include_usage`),
then `data: [DONE]`. A failure after the first chunk ends the stream with `data: {"error": ...}`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcake.ids import RandomIds
from kvcake.server.frontend.api_key import ApiKeyGuard
from kvcake.server.frontend.backend import Backend, FinishReason, Rejected, TokenEvent
from kvcake.server.frontend.body_reader import check_prompt_chars, read_body
from kvcake.server.frontend.detokenizer import TextStream
from kvcake.server.frontend.http_server import ApiServer as ApiServer
from kvcake.server.frontend.http_server import listen_socket as listen_socket
from kvcake.server.frontend.job import Job, close_all, merged
from kvcake.server.frontend.limits import HttpLimits
from kvcake.server.frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvcake.server.frontend.metrics import RequestTimer, ServerMetrics
from kvcake.server.frontend.openapi import request_body
from kvcake.server.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InvalidRequest,
    TokenizeRequest,
    build_generate_request,
    parse_request,
    prompt_token_ids,
    stop_strings,
)
from kvcake.server.frontend.responses import (
    ResponseHead,
    chat_body,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    error_body,
    prompt_entries,
    usage,
    usage_chunk,
)
from kvcake.types import RequestId


class ApiFactory:
    """Builds the FastAPI app; one per server (its metrics are its own)."""

    def __init__(self, backend: Backend, metrics: ServerMetrics | None = None,
                 now_s: Callable[[], float] = time.monotonic,
                 wall_s: Callable[[], float] = time.time,
                 limits: HttpLimits | None = None) -> None:
        self.backend = backend
        self.metrics = metrics or ServerMetrics(backend.model_name)
        for collector in getattr(backend, "collectors", ()):  # e.g. the store master's
            self.metrics.registry.register(collector)
        self.limits = limits or HttpLimits()
        self._now_s, self._wall_s = now_s, wall_s
        self._ids = {"completion": RandomIds("cmpl"), "chat": RandomIds("chatcmpl")}

    def build(self) -> FastAPI:
        app = FastAPI(title="kvcake", docs_url=None, redoc_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/metrics", self.render_metrics, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"],
                          openapi_extra=request_body(CompletionRequest))
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"],
                          openapi_extra=request_body(ChatCompletionRequest))
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"],
                          openapi_extra=request_body(TokenizeRequest))
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"],
                          openapi_extra=request_body(DetokenizeRequest))
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_exception_handler(StarletteHTTPException, self._http_error)  # type: ignore[arg-type]
        return app

    async def _http_error(self, _request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths and wrong methods get OpenAI's error body too."""
        return self._error(str(exc.detail), exc.status_code)

    async def health(self) -> dict[str, Any]:
        """{"status": "ok"}, plus "workers": how many are live, for a backend with workers
        (with etcd membership, those that have joined)."""
        live = self.backend.stats().extra.get("live_workers")
        return {"status": "ok"} if live is None else {"status": "ok", "workers": int(live)}

    async def models(self) -> dict[str, Any]:
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "kvcake",
                  "root": self.backend.model_name, "max_model_len": self.backend.max_model_len,
                  "vocab_size": self.backend.vocab_size} for name in self._served_names()]
        return {"object": "list", "data": cards}

    def _served_names(self) -> tuple[str, ...]:
        """`--served-model-name`s (every one is accepted; the first is reported)."""
        return tuple(getattr(self.backend, "served_model_names", ())) or \
            (self.backend.model_name,)

    async def render_metrics(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(self.backend.stats()),
                                 media_type=METRICS_CONTENT_TYPE)

    async def version(self) -> dict[str, str]:
        return {"version": _VERSION}

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {count, max_model_len, tokens} of a prompt or a chat."""
        try:
            body = parse_request(TokenizeRequest, await self._body(request))
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidRequest("send exactly one of prompt and messages", "prompt")
            if body.messages is not None:
                messages = [(m.role, m.text()) for m in body.messages]
                self._check_prompt_chars([text for _role, text in messages])
                tokens = self.backend.chat_prompt(messages)
            else:
                assert body.prompt is not None
                self._check_prompt_chars([body.prompt])
                tokens = self.backend.encode(body.prompt)
            return JSONResponse({"count": len(tokens), "max_model_len":
                                 self.backend.max_model_len, "tokens": list(tokens)})
        except ValueError as exc:
            return self._invalid(exc)

    async def detokenize(self, request: Request) -> Response:
        try:
            body = parse_request(DetokenizeRequest, await self._body(request))
            self._check_model(body.model)
            vocab = self.backend.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"tokens: {bad} is outside the vocabulary [0, {vocab})",
                                     "tokens")
            return JSONResponse({"prompt": self.backend.decode(body.tokens)})
        except ValueError as exc:
            return self._invalid(exc)

    async def completions(self, request: Request) -> Response:
        try:
            body = parse_request(CompletionRequest, await self._body(request))
            self._check_model(body.model)
            self._check_prompt_chars([body.prompt] if isinstance(body.prompt, str)
                                     else [p for p in body.prompt if isinstance(p, str)])
            token_ids = prompt_token_ids(body.prompt, self.backend.encode)
            return await self._serve(request, "completion", body, token_ids, body.max_tokens)
        except ValueError as exc:  # InvalidRequest, or a tokenizer/backend refusal
            return self._invalid(exc)

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = parse_request(ChatCompletionRequest, await self._body(request))
            self._check_model(body.model)
            messages = [(m.role, m.text()) for m in body.messages]
            self._check_prompt_chars([text for _role, text in messages])
            token_ids = self.backend.chat_prompt(messages)
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await self._serve(request, "chat", body, token_ids, max_tokens)
        except ValueError as exc:  # InvalidRequest, or a tokenizer/backend refusal
            return self._invalid(exc)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.limits)

    def _check_prompt_chars(self, texts: list[str]) -> None:
        check_prompt_chars(self.limits, self.backend.max_model_len, texts)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._served_names():
            names = " or ".join(repr(n) for n in self._served_names())
            raise InvalidRequest(f"model {model!r} does not exist; this server serves "
                                 f"{names}", "model", 404, "model_not_found")

    def _invalid(self, exc: ValueError) -> JSONResponse:
        if isinstance(exc, InvalidRequest):
            return self._error(exc.message, exc.status, exc.param, exc.code)
        return self._error(str(exc), 400)

    def _error(self, message: str, status: int, param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
        self.metrics.on_http_error(status)
        return JSONResponse(error_body(message, status, param, code), status, headers=headers)

    async def _serve(self, request: Request, kind: str,
                     body: CompletionRequest | ChatCompletionRequest, token_ids: list[int],
                     max_tokens: int | None) -> Response:
        """Admit the request's `n` choices (each its own backend request, seeded seed + i; the
        prompt's KV is shared through the prefix cache) and answer them as one response."""
        request_id = self._ids[kind].next_id()
        echo = self.backend.decode(token_ids) if getattr(body, "echo", False) else ""
        jobs: list[Job] = []
        for index in range(body.n):
            seeded = body if body.seed is None or index == 0 else \
                body.model_copy(update={"seed": body.seed + index})
            backend_id = request_id if body.n == 1 else f"{request_id}-{index}"
            gen = build_generate_request(RequestId(backend_id), token_ids, seeded, max_tokens,
                                         self.backend.vocab_size, self.backend.max_model_len)
            timer = RequestTimer(self._now_s())
            try:
                stream = await self.backend.generate(gen)
            except Rejected as exc:
                await close_all(jobs)
                self.metrics.on_rejected(exc.kind)
                retry = str(max(1, math.ceil(exc.retry_after_s)))
                return self._error(exc.reason, 429, None, "rejected", {"Retry-After": retry})
            except ValueError:
                await close_all(jobs)
                raise  # the backend refuses the request as invalid: the route answers 400
            except Exception as exc:
                await close_all(jobs)
                return self._error(f"the backend failed to admit the request: {exc}", 500)
            self.metrics.on_admitted(len(token_ids))
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            jobs.append(Job(request_id, kind, len(token_ids), stream, timer, include_usage,
                             body.return_token_ids, int(self._wall_s()),
                             TextStream(self.backend.decode, stop_strings(body.stop)),
                             index=index, wants_logprobs=gen.logprobs is not None,
                             echo=echo, prompt_token_ids=gen.prompt_token_ids,
                             drop_output=kind == "completion" and max_tokens == 0))
        if body.stream:
            # The background close covers a client gone before the body is ever iterated.
            return StreamingResponse(self._sse(jobs), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(close_all, jobs))
        return await self._whole(request, jobs)

    async def _events(self, job: Job) -> AsyncIterator[tuple[TokenEvent, str]]:
        """The backend's events with their new text; records timing and finishes the job."""
        try:
            async for event in job.stream:
                if job.drop_output:  # max_tokens 0: the prompt alone answers
                    event = replace(event, token_ids=(), logprobs=None,
                                    finish_reason=FinishReason.LENGTH)
                job.timer.on_tokens(self._now_s())
                if event.queue_s is not None:
                    job.timer.queue_s, job.timer.prefill_s = event.queue_s, event.prefill_s
                job.num_cached_tokens = event.num_cached_tokens
                if event.prompt_logprobs is not None:
                    job.prompt_logprobs = prompt_entries(job.prompt_token_ids,
                                                         event.prompt_logprobs)
                if event.logprobs:
                    job.logprobs.extend(event.logprobs)
                final = event.finish_reason is not None
                if final:
                    job.finish_reason = event.finish_reason  # type: ignore[assignment]
                text = job.text.push(event.token_ids, final)
                if job.text.stopped:  # a stop string: the output ends before it
                    job.finish_reason = FinishReason.STOP
                    yield replace(event, finish_reason=FinishReason.STOP), text
                    break  # closing the stream aborts the rest of the generation
                yield event, text
        finally:
            await job.stream.aclose()
            self.metrics.on_finished(job.timer, self._now_s(), job.num_cached_tokens,
                                     len(job.text.token_ids), job.finish_reason)

    def _usage(self, jobs: list[Job]) -> dict[str, Any]:
        """The prompt counted once (its KV is shared), every choice's tokens."""
        first = jobs[0]
        return usage(first.num_prompt_tokens, sum(len(j.text.token_ids) for j in jobs),
                     first.num_cached_tokens)

    async def _whole(self, request: Request, jobs: list[Job]) -> Response:
        async def collect(job: Job) -> str:
            return "".join([text async for _event, text in self._events(job)])

        work = asyncio.ensure_future(asyncio.gather(*(collect(job) for job in jobs)))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            waiters: set[asyncio.Future[Any]] = {work, gone}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left: cancelling aborts the request
                work.cancel()
        if work.cancelled():
            await close_all(jobs)  # idempotent; covers tasks cancelled before they started
            return Response(status_code=499)
        try:
            texts = work.result()
        except Exception as exc:
            await close_all(jobs)
            return self._error(f"generation failed: {exc}", 500)
        name, first = self.backend.model_name, jobs[0]
        choices = []
        for job, text in zip(jobs, texts, strict=True):
            ids = job.text.token_ids if job.return_token_ids else None
            make = chat_body if job.kind == "chat" else completion_body
            out = make(ResponseHead(job.request_id, job.created, name), job.echo + text,
                       job.finish_reason, self._usage(jobs), ids)
            choices.append({**out["choices"][0], "index": job.index,
                            "logprobs": self._logprobs(job, job.prompt_logprobs + job.logprobs,
                                                       0 if job.prompt_logprobs else
                                                       len(job.echo))})
        return JSONResponse({**out, "id": first.request_id, "choices": choices})

    def _logprobs(self, job: Job, entries: list[Any], offset: int) -> dict[str, Any] | None:
        if not job.wants_logprobs:
            return None
        if job.kind == "chat":
            return chat_logprobs(entries, self.backend.decode)
        return completion_logprobs(entries, self.backend.decode, offset)

    async def _sse(self, jobs: list[Job]) -> AsyncIterator[str]:
        model, first = self.backend.model_name, {job.index: True for job in jobs}
        try:
            async for job, event, text in merged(self._events, jobs):
                ids = event.token_ids if job.return_token_ids else None
                head = ResponseHead(job.request_id, job.created, model)
                if job.kind == "chat":
                    chunk = chat_chunk(head, text, event.finish_reason, first[job.index], ids)
                else:
                    if first[job.index]:  # echo: the prompt's text leads the first chunk
                        text = job.echo + text
                        job.text_len = len(job.echo)
                    chunk = completion_body(head, text, event.finish_reason, None, ids)
                chunk["choices"][0]["index"] = job.index
                entries, offset = list(event.logprobs or ()), job.text_len
                if first[job.index] and job.prompt_logprobs:  # echo: the prompt's lead
                    entries, offset = job.prompt_logprobs + entries, 0
                chunk["choices"][0]["logprobs"] = self._logprobs(job, entries, offset)
                job.text_len += len(text) - (len(job.echo) if first[job.index] else 0)
                first[job.index] = False
                yield _sse_data(chunk)
        except Exception as exc:  # after the headers went out: report it in the stream
            self.metrics.on_http_error(500)
            yield _sse_data(error_body(f"generation failed: {exc}", 500))
            return
        job = jobs[0]
        if job.include_usage:
            name = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
            yield _sse_data(usage_chunk(name, ResponseHead(job.request_id, job.created, model),
                                        self._usage(jobs)))
        yield "data: [DONE]\n\n"


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcake")
    except PackageNotFoundError:
        return "0+unknown"


_VERSION = _package_version()


_JSON = json.JSONEncoder(ensure_ascii=False)  # one encoder, not one per streamed chunk


def _sse_data(payload: dict[str, Any]) -> str:
    return f"data: {_JSON.encode(payload)}\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read; only disconnect remains)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(backend: Backend, metrics: ServerMetrics | None = None,
               limits: HttpLimits | None = None, api_key: str | None = None) -> FastAPI:
    """The app serving `backend`; the caller starts and closes the backend. `api_key`: `/v1`
    asks for `Authorization: Bearer <api_key>` (api_key.py; `/health`, `/metrics` stay open)."""
    app = ApiFactory(backend, metrics, limits=limits).build()
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, keys=(api_key,))
    return app

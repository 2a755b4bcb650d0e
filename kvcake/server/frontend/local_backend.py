"""One engine instance in-process, behind the `Backend` contract: the colocated serving path.

The engine is single-threaded, so one engine-loop thread (started by `start()`) owns it: it
takes commands (add, abort, stop) from a thread-safe inbox, calls `engine.step()` while any
request is unfinished (continuous batching across every concurrent HTTP request), and hands
each request's new tokens to that request's asyncio queue with `call_soon_threadsafe`. When
nothing is unfinished the thread blocks on the inbox, so an idle server burns no CPU.

Admission control (a real feature, not a test hook): with `max_waiting_requests = N`, a request
that arrives while N requests are still waiting for their first token is refused with
`Rejected` (HTTP 429, `Retry-After: retry_after_s`) before it reaches the engine.

Lifecycle of one request:
  generate() -> [admission check] -> inbox "add" -> engine.add_request (ValueError -> 400)
  -> step() outputs -> TokenEvent per step -> final event (finish_reason) -> stream ends.
  Closing the stream early sends "abort": the engine frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcake.engine import cpu_ops
from kvcake.engine.chat_template import ChatTemplate
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine, RequestOutput
from kvcake.engine.sampling import SamplingParams
from kvcake.engine.sequence import FinishReason as EngineFinish
from kvcake.engine.step_trace import StepTrace
from kvcake.server.frontend.backend import (
    BackendStats,
    FinishReason,
    GenerateRequest,
    QueueTokenStream,
    Rejected,
    TokenEvent,
    logprobs_of,
    prompt_logprobs_of,
)
from kvcake.server.frontend.protocol import render_chat_text

_FINISH = {EngineFinish.STOP: FinishReason.STOP, EngineFinish.LENGTH: FinishReason.LENGTH,
           EngineFinish.ABORT: FinishReason.ABORT}


@dataclass(frozen=True)
class LocalBackendConfig:
    model: str = "tiny"
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_waiting_requests: int | None = None  # None: no admission limit
    retry_after_s: float = 1.0
    num_threads: int | None = None  # torch intra-op threads of the engine; None: torch's default
    bind_threads: bool = False  # those threads one per CPU of the process (`thread_cpus`)
    bind_engine_thread: bool = True  # with bind_threads: thread 0 (the engine thread) too
    served_model_names: tuple[str, ...] = ()  # (): the model's own name
    # `kvcake serve` only: the engine in a child process (`ProcessBackend`), not a thread here
    engine_process: bool = False

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None (no limit), got "
                             f"{self.max_waiting_requests}")
        if not self.retry_after_s > 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")


def thread_cpus(num_threads: int, allowed: set[int]) -> list[int] | None:
    """The CPUs to bind `num_threads` intra-op threads to, one each: the lowest of `allowed` (the
    process's affinity); None when there are fewer CPUs than threads (binding two threads to
    one CPU would only serialise them)."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    cpus = sorted(allowed)
    return cpus[:num_threads] if len(cpus) >= num_threads else None


def bind_engine_threads(num_threads: int, engine_thread: bool = True) -> list[int]:
    """On the engine thread: bind its intra-op pool one thread per CPU (`thread_cpus`); the CPUs
    bound per pool thread, [] when not possible (too few CPUs, no kvcake CPU ops), with the
    reason logged. `engine_thread=False`: the calling thread (the pool's thread 0) gets its
    whole affinity back, only the worker threads stay bound (its entry is then -1). One thread
    is left unbound: binding keeps a pool's threads off each other's CPU, and a lone engine
    thread pinned to the lowest CPU would pile every single-threaded server of a host on it."""
    if num_threads < 2:
        return []
    allowed = os.sched_getaffinity(0)
    cpus = thread_cpus(num_threads, allowed)
    if cpus is None or not cpu_ops.load():
        why = "fewer CPUs than threads" if cpus is None else cpu_ops.load_error()
        print(f"kvcake: --bind-threads: threads left unbound ({why})", file=sys.stderr)
        return []
    bound = cpu_ops.bind_threads(cpus)
    if not engine_thread:
        os.sched_setaffinity(0, allowed)  # pid 0: this thread only
        bound = [-1, *bound[1:]]
    print(f"kvcake: engine threads bound to CPUs {bound} (-1: floating)", file=sys.stderr)
    return bound


@dataclass
class _Add:
    request: GenerateRequest
    sink: asyncio.Queue[TokenEvent | BaseException]
    loop: asyncio.AbstractEventLoop
    admitted: concurrent.futures.Future[None]
    started: bool = False  # produced its first token (no longer waiting)


@dataclass
class _Abort:
    request_id: str


def token_event(output: RequestOutput, first: bool) -> TokenEvent:
    """The stream event of one engine output; a request's `first` also carries its queue and
    prefill seconds."""
    queue_s = prefill_s = None
    if first and output.first_scheduled_s is not None and output.first_token_s is not None:
        queue_s = output.first_scheduled_s - output.arrival_s
        prefill_s = output.first_token_s - output.first_scheduled_s
    reason = _FINISH.get(output.finish_reason) if output.finish_reason else None
    return TokenEvent(tuple(output.new_token_ids), output.num_cached_tokens, reason,
                      logprobs_of(output.logprobs), prompt_logprobs_of(output.prompt_logprobs),
                      queue_s, prefill_s)


class LocalBackend:
    """See the module docstring. `start()` before `generate`; `close()` stops the thread."""

    def __init__(self, engine: Engine, config: LocalBackendConfig | None = None) -> None:
        self.engine = engine
        self.config = config or LocalBackendConfig()
        self._inbox: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._num_waiting = 0  # admitted, no token yet (guarded by _lock)
        self._stats = BackendStats()
        self._num_live = 0  # requests the engine thread holds (written by it only)
        self.bound_cpus: list[int] = []  # with bind_threads: the CPUs the engine's threads got
        model_dir = Path(self.config.model)
        self._chat_template = ChatTemplate.load(model_dir) if model_dir.is_dir() else None

    @classmethod
    def from_config(cls, config: LocalBackendConfig) -> LocalBackend:
        return cls(Engine(config.model, config.engine), config)

    # -- the Backend contract ------------------------------------------------------------------
    @property
    def served_model_names(self) -> tuple[str, ...]:
        return tuple(self.config.served_model_names) or (self.engine.model_config.name,)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def encode(self, text: str) -> list[int]:
        if self.engine.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer.json; send token ids instead "
                             "of text")
        return self.engine.tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.engine.tokenizer is None:
            return ""
        return self.engine.tokenizer.decode(list(token_ids))

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The model's template rendered as transformers' `apply_chat_template` does (special
        tokens written by the template, none added); else the built-in one."""
        if self._chat_template is None:
            return self.encode(render_chat_text(messages))
        if self.engine.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer.json; use /v1/completions "
                             "with token ids")
        text = self._chat_template.render([{"role": r, "content": c} for r, c in messages])
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    async def generate(self, request: GenerateRequest) -> QueueTokenStream:
        """Admit `request` (Rejected when the waiting queue is full; ValueError when the engine
        refuses it) and return its token stream."""
        if self._thread is None:
            raise RuntimeError("LocalBackend.generate() before start()")
        limit = self.config.max_waiting_requests
        with self._lock:
            if limit is not None and self._num_waiting >= limit:
                raise Rejected(f"{self._num_waiting} requests are already waiting for prefill "
                               f"(limit {limit}); retry later", self.config.retry_after_s,
                               "max_waiting_requests")
            self._num_waiting += 1
        sink: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        admitted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._inbox.put(_Add(request, sink, asyncio.get_running_loop(), admitted))
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            self._abort(request.request_id)
            raise
        return QueueTokenStream(self._abort, request.request_id, sink)

    def _abort(self, request_id: str) -> None:
        """Thread-safe: the engine loop aborts the request at its next step."""
        self._inbox.put(_Abort(request_id))

    def stats(self) -> BackendStats:
        return self._stats

    @property
    def num_live_requests(self) -> int:
        """Requests in the engine now (admitted, not finished or aborted)."""
        return self._num_live

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LocalBackend already started")
        self._thread = threading.Thread(target=self._loop, name="kvcake-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None

    def __enter__(self) -> LocalBackend:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine-loop thread ----------------------------------------------------------------
    def _loop(self) -> None:
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)  # set here: OpenMP is per thread
        if self.config.bind_threads:
            self.bound_cpus = bind_engine_threads(torch.get_num_threads(),
                                                  self.config.bind_engine_thread)
        trace = StepTrace.from_env("single")  # diagnostics, off unless $KVCAKE_STEP_TRACE is set
        try:
            self._serve(trace)
        finally:
            if trace is not None:
                trace.close()

    def _serve(self, trace: StepTrace | None) -> None:
        live: dict[str, _Add] = {}
        while True:
            for command in self._drain(block=not self.engine.has_unfinished()):
                if command is None:
                    self._fail_all(live, RuntimeError("the server is shutting down"))
                    return
                self._apply(command, live)
            self._num_live = len(live)
            self._update_stats()
            if not self.engine.has_unfinished():
                continue
            if trace is not None:
                rows = [(s.request_id, s.num_tokens) for s in self.engine.batcher.running]
                t0, c0 = trace.now(), trace.cpu()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in the engine: fail these requests, keep serving
                self._fail_all(live, RuntimeError(f"engine step failed: {exc!r}"))
                continue
            if trace is not None:
                t1, c1 = trace.now(), trace.cpu()
            # one wake-up of each request loop per step, not one per request (batch > 1)
            _post_all([posted for output in outputs
                       if (posted := self._deliver(output, live)) is not None])
            if trace is not None:
                trace.record(t0, t1, trace.now(), c1 - c0, rows)
            self._num_live = len(live)
            self._update_stats()

    def _drain(self, block: bool) -> list[_Add | _Abort | None]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort, live: dict[str, _Add]) -> None:
        if isinstance(command, _Abort):
            add = live.pop(command.request_id, None)
            if add is not None:
                self.engine.abort(command.request_id)
                if not add.started:
                    self._leave_waiting()
            return
        request = command.request
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids,
                                    _sampling_params(request))
        except Exception as exc:  # ValueError: bad input (400); anything else: a server error
            self._leave_waiting()
            command.admitted.set_exception(exc)
            return
        live[request.request_id] = command
        command.admitted.set_result(None)

    def _deliver(self, output: RequestOutput,
                 live: dict[str, _Add]) -> tuple[_Add, TokenEvent] | None:
        """The event `output` makes for its request's stream (None: the request is gone)."""
        add = live.get(output.request_id)
        if add is None:  # aborted in the meantime
            return None
        first = not add.started
        if first:
            add.started = True
            self._leave_waiting()
        if output.finished:  # forget it before its reader can see the end
            del live[output.request_id]
            self._num_live = len(live)
        return add, token_event(output, first)

    def _fail_all(self, live: dict[str, _Add], error: Exception) -> None:
        for request_id, add in list(live.items()):
            self.engine.abort(request_id)
            if not add.started:
                self._leave_waiting()
            _post(add, error)
        live.clear()

    def _leave_waiting(self) -> None:
        with self._lock:
            self._num_waiting -= 1

    def _update_stats(self) -> None:
        batcher, blocks = self.engine.batcher, self.engine.block_manager
        self._stats = BackendStats(
            num_waiting_requests=len(batcher.waiting), num_running_requests=len(batcher.running),
            kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.num_blocks)


def _post(add: _Add, item: TokenEvent | BaseException) -> None:
    """Hand `item` to the request's event loop; a loop already closed has no reader left."""
    try:
        add.loop.call_soon_threadsafe(add.sink.put_nowait, item)
    except RuntimeError:
        pass


def _post_all(posts: Sequence[tuple[_Add, TokenEvent]]) -> None:
    """Hand a step's events to their requests' loops: one `call_soon_threadsafe` (one wake-up of
    that loop's thread) per loop, the events in step order; a closed loop is skipped."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], TokenEvent]]] = {}
    for add, event in posts:
        by_loop.setdefault(add.loop, []).append((add.sink, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:
            pass


def _put_all(items: list[tuple[asyncio.Queue[Any], TokenEvent]]) -> None:
    for sink, event in items:
        sink.put_nowait(event)


def _sampling_params(request: GenerateRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=request.max_tokens, temperature=request.temperature,
        top_k=request.top_k or None, top_p=request.top_p, seed=request.seed,
        stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens, repetition_penalty=request.repetition_penalty,
        frequency_penalty=request.frequency_penalty, presence_penalty=request.presence_penalty,
        min_p=request.min_p, logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs)

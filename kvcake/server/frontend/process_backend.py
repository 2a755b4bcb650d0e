"""The single-mode engine in a process of its own, behind the `Backend` contract (opt-in:
`kvcake serve --mode single --engine-process`).

`LocalBackend` runs the engine loop as a thread of the HTTP process, so the two share the
interpreter lock: while the HTTP thread streams a token, the engine thread cannot run Python
between its torch ops. Here the engine loop is the main thread of a child process (spawned, so
no torch or OpenMP state is inherited), as vLLM runs its engine core apart from its API server.
The frontend keeps the tokenizer (`ModelFront`) and talks to the child over one pipe:

  parent -> child: ("add", GenerateRequest) | ("abort", request_id) | None (stop)
  child -> parent: ("ready", max_model_len) once, then per batch of commands ("acks", [(id,
  None | exception)], stats) and per engine step ("events", [(id, TokenEvent)], stats), or
  ("failed", [ids], message) when a step raised.

A reader thread in the parent hands each step's events to the request loops (one wake-up per
loop, as `LocalBackend`). Admission (`max_waiting_requests`), errors (ValueError -> 400) and
aborts behave as in `LocalBackend`; if the child dies, every open stream fails and new requests
get a RuntimeError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any

from kvcake.engine.build import max_model_len_of
from kvcake.engine.step_trace import StepTrace
from kvcake.server.frontend.backend import (
    BackendStats,
    GenerateRequest,
    QueueTokenStream,
    Rejected,
    TokenEvent,
)
from kvcake.server.frontend.local_backend import (
    LocalBackendConfig,
    _Add,
    _post,
    _post_all,
    _sampling_params,
    token_event,
)
from kvcake.server.frontend.model_front import ModelFront

_Stats = tuple[int, int, float]  # waiting, running, KV usage


def _stats_of(engine: Any) -> _Stats:
    blocks = engine.block_manager
    return (len(engine.batcher.waiting), len(engine.batcher.running),
            1.0 - blocks.num_free_blocks / blocks.num_blocks)


def _child_engine(config: LocalBackendConfig) -> Any:
    """The child's engine, its torch threads set and bound as the in-process backend's."""
    import torch

    from kvcake.conductor.heap import freeze_heap
    from kvcake.engine.engine import Engine
    from kvcake.server.frontend.local_backend import bind_engine_threads

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    engine = Engine(config.model, config.engine)
    if config.bind_threads:
        bind_engine_threads(torch.get_num_threads(), config.bind_engine_thread)
    freeze_heap()
    return engine


def _apply_commands(engine: Any, commands: list[Any], live: dict[str, bool],
                    ) -> list[tuple[str, BaseException | None]] | None:
    """Adds and aborts from the frontend; the adds' acknowledgements (an exception for a
    refused request), or None on the stop command."""
    acks: list[tuple[str, BaseException | None]] = []
    for command in commands:
        if command is None:
            return None
        kind, arg = command
        if kind == "abort":
            if live.pop(arg, None) is not None:
                engine.abort(arg)
            continue
        try:
            engine.add_request(arg.request_id, arg.prompt_token_ids, _sampling_params(arg))
        except Exception as exc:  # ValueError: bad input (400); else a server error
            acks.append((arg.request_id, exc))
            continue
        live[arg.request_id] = False
        acks.append((arg.request_id, None))
    return acks


def _token_events(outputs: list[Any], live: dict[str, bool]) -> list[tuple[str, TokenEvent]]:
    """One step's outputs as the frontend's token events (aborted requests dropped; a
    request's first event carries its queue and prefill seconds)."""
    events: list[tuple[str, TokenEvent]] = []
    for output in outputs:
        started = live.get(output.request_id)
        if started is None:  # aborted in the meantime
            continue
        live[output.request_id] = True
        if output.finished:
            del live[output.request_id]
        events.append((output.request_id, token_event(output, not started)))
    return events


def engine_process_main(config: LocalBackendConfig, conn: Connection) -> None:
    """The child: build the engine, then step it while any request is unfinished, blocking on
    the pipe when idle (an idle server burns no CPU)."""
    engine = _child_engine(config)
    trace = StepTrace.from_env("single")  # diagnostics, off unless $KVCAKE_STEP_TRACE is set
    conn.send(("ready", engine.max_model_len))
    try:
        _serve(engine, conn, trace)
    finally:
        if trace is not None:
            trace.close()


def _serve(engine: Any, conn: Connection, trace: StepTrace | None) -> None:
    """The child's loop: commands in, one step, its token events out, until the stop command."""
    live: dict[str, bool] = {}  # request id -> produced its first token
    while True:
        commands = [] if engine.has_unfinished() else [conn.recv()]
        while conn.poll():
            commands.append(conn.recv())
        acks = _apply_commands(engine, commands, live)
        if acks is None:
            return
        if acks:
            conn.send(("acks", acks, _stats_of(engine)))
        if not engine.has_unfinished():
            continue
        if trace is not None:
            rows = [(seq.request_id, seq.num_tokens) for seq in engine.batcher.running]
            t0, c0 = trace.now(), trace.cpu()
        try:
            outputs = engine.step()
        except Exception as exc:  # a bug in the engine: fail these requests, keep serving
            for request_id in live:
                engine.abort(request_id)
            conn.send(("failed", list(live), f"engine step failed: {exc!r}"))
            live.clear()
            continue
        if trace is not None:
            t1, c1 = trace.now(), trace.cpu()
        conn.send(("events", _token_events(outputs, live), _stats_of(engine)))
        if trace is not None:
            trace.record(t0, t1, trace.now(), c1 - c0, rows)


class ProcessBackend(ModelFront):
    """See the module docstring. `start()` (spawns the engine, waits until it is built) before
    `generate`; `close()` stops it."""

    def __init__(self, config: LocalBackendConfig) -> None:
        super().__init__(config.model, config.served_model_names)
        self.config = config
        self._max_model_len = max_model_len_of(self._model_config, config.engine)
        self._conn: Connection | None = None
        self._process: Any = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _streams, _num_waiting, _dead, sends
        self._streams: dict[str, _Add] = {}
        self._num_waiting = 0
        self._dead: str | None = None  # why the engine process is gone
        self._stats = BackendStats()

    # -- the Backend contract (the tokenizer's part is ModelFront's) ---------------------------
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def stats(self) -> BackendStats:
        return self._stats

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    async def generate(self, request: GenerateRequest) -> QueueTokenStream:
        if self._reader is None:
            raise RuntimeError("ProcessBackend.generate() before start()")
        limit = self.config.max_waiting_requests
        add = _Add(request, asyncio.Queue(), asyncio.get_running_loop(),
                   concurrent.futures.Future())
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            if limit is not None and self._num_waiting >= limit:
                raise Rejected(f"{self._num_waiting} requests are already waiting for prefill "
                               f"(limit {limit}); retry later", self.config.retry_after_s,
                               "max_waiting_requests")
            self._num_waiting += 1
            self._streams[request.request_id] = add
            self._send(("add", request))
        try:
            await asyncio.wrap_future(add.admitted)
        except asyncio.CancelledError:
            self._abort(request.request_id)
            raise
        return QueueTokenStream(self._abort, request.request_id, add.sink)

    def _send(self, message: Any) -> None:
        """With `_lock` held; a dead child is noticed by the reader."""
        assert self._conn is not None
        try:
            self._conn.send(message)
        except OSError:
            pass

    def _abort(self, request_id: str) -> None:
        with self._lock:
            add = self._streams.pop(request_id, None)
            if add is None:
                return
            if not add.started:
                self._num_waiting -= 1
            self._send(("abort", request_id))

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("ProcessBackend already started")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=engine_process_main, args=(self.config, child),
                                    name="kvcake-engine", daemon=True)
        self._process.start()
        child.close()  # only the child holds its end: its exit reads as EOF here
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited while starting (exit code "
                               f"{self._process.exitcode}); see its error above") from None
        self._max_model_len = int(message[1])
        self._reader = threading.Thread(target=self._read, name="kvcake-engine-reader",
                                        daemon=True)
        self._reader.start()

    def close(self) -> None:
        if self._reader is None:
            return
        with self._lock:
            self._send(None)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join()
        self._reader = None
        assert self._conn is not None
        self._conn.close()

    def __enter__(self) -> ProcessBackend:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        assert self._conn is not None
        while True:
            try:
                kind, items, extra = self._conn.recv()
            except (EOFError, OSError):
                self._fail_all("the engine process exited")
                return
            if kind == "events":
                self._deliver(items)
                self._stats = BackendStats(*extra)
            elif kind == "acks":
                self._ack(items)
                self._stats = BackendStats(*extra)
            else:  # "failed": that step's requests end with the error
                with self._lock:
                    failed = [self._forget(rid) for rid in items]
                for add in failed:
                    if add is not None:
                        _post(add, RuntimeError(extra))

    def _forget(self, request_id: str) -> _Add | None:
        """With `_lock` held: the request's stream, no longer live."""
        add = self._streams.pop(request_id, None)
        if add is not None and not add.started:
            self._num_waiting -= 1
        return add

    def _ack(self, acks: list[tuple[str, BaseException | None]]) -> None:
        for request_id, error in acks:
            with self._lock:
                add = self._forget(request_id) if error is not None else \
                    self._streams.get(request_id)
            if add is None:
                continue
            if error is None:
                add.admitted.set_result(None)
            else:
                add.admitted.set_exception(error)

    def _deliver(self, events: list[tuple[str, TokenEvent]]) -> None:
        posts: list[tuple[_Add, TokenEvent]] = []
        with self._lock:
            for request_id, event in events:
                add = self._streams.get(request_id)
                if add is None:  # aborted in the meantime
                    continue
                if not add.started:
                    add.started = True
                    self._num_waiting -= 1
                if event.finish_reason is not None:
                    del self._streams[request_id]
                posts.append((add, event))
        _post_all(posts)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._dead = why
            adds = [self._forget(rid) for rid in list(self._streams)]
        for add in adds:
            if add is None:
                continue
            if not add.admitted.done():
                add.admitted.set_exception(RuntimeError(why))
            else:
                _post(add, RuntimeError(why))

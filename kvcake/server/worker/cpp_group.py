"""A CPP prefill group of member processes on this host (`CppMember`s chained by pipes, hidden
states through each member's shared-memory inbox segment): what `benchmarks/cpp_prefill.py`
measures and what the tests run. The driver side (`CppGroup`) cuts a prompt into chunks, feeds
member 0 and waits for the last member's first token and every member's `CppDone`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvcake.engine.config import EngineConfig
from kvcake.server.worker.cpp_stage import (
    CppBegin,
    CppChunk,
    CppDone,
    CppFirstToken,
    CppMember,
    CppStop,
    KvTarget,
    chunks,
)

_START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CppResult:
    first_token: int
    ttft_s: float  # from the first chunk sent to the first token received
    compute_s: tuple[float, ...]  # each member's forward time, pipeline order
    kv_bytes: tuple[int, ...]  # KV each member streamed to the decode side


@dataclass(frozen=True)
class CppGroupConfig:
    """How a group's members run. `chunk_tokens`: prompt tokens per chunk; `slots`: chunks
    each inbox holds; `threads`: torch threads of each member process; `in_process`: members
    run as threads of this process instead (tests: no start-up of processes; same messages,
    same shared-memory inboxes and transfer engines)."""

    chunk_tokens: int
    slots: int = 2
    threads: int = 1
    in_process: bool = False


@dataclass(frozen=True)
class _Member:
    """What one member process is started with (pickled to it)."""

    model: str
    config: EngineConfig
    layers: range
    member: int  # its stage
    chunk_tokens: int
    slots: int
    threads: int  # torch threads of its own process; 0: a thread member


def _member_main(spec: _Member, ctl: Connection, up: Connection, down: Connection) -> None:
    if spec.threads > 0:  # a process of its own (a thread member shares its process's pool)
        import torch

        torch.set_num_threads(spec.threads)
    from kvcake.engine.stage import StageEngine
    from kvcake.transfer import SegmentDesc, TransferConfig, TransferEngine

    stage = StageEngine(spec.model, spec.layers, spec.config)
    with TransferEngine(TransferConfig(port=0)) as transfer:
        m = CppMember(stage, transfer, member=spec.member, chunk_tokens=spec.chunk_tokens,
                      slots=spec.slots, tag=f"{spec.member}-{os.getpid()}-{threading.get_ident()}")
        ctl.send(None if m.inbox is None else m.inbox.to_dict())
        nxt = ctl.recv()
        if nxt is not None:
            m.connect_next(SegmentDesc.from_dict(nxt))
        ctl.send("ready")
        m.run(up, down)


class CppGroup:
    def __init__(self, model: str, num_members: int, config: EngineConfig,
                 group: CppGroupConfig) -> None:
        """`num_members` stages of `model`, each started with `config` and run as `group` says."""
        from kvcake.engine.loader import resolve
        from kvcake.engine.stage import split_layers

        layers = split_layers(resolve(model).config.num_layers, num_members)
        self.chunk_tokens = group.chunk_tokens
        ctx = mp.get_context("spawn")
        make = threading.Thread if group.in_process else ctx.Process
        self._procs: list[Any] = []
        ctls: list[Connection] = []
        self._head, up = ctx.Pipe()
        for member, span in enumerate(layers):
            down_here, down_there = ctx.Pipe()
            ctl_here, ctl_there = ctx.Pipe()
            spec = _Member(model, config, span, member, group.chunk_tokens, group.slots,
                           0 if group.in_process else group.threads)
            proc = make(target=_member_main, daemon=True,
                        args=(spec, ctl_there, up, down_here))
            proc.start()
            self._procs.append(proc)
            ctls.append(ctl_here)
            up = down_there
        self._tail = up
        inboxes = [self._recv(c) for c in ctls]
        for member, ctl in enumerate(ctls):
            ctl.send(inboxes[member + 1] if member + 1 < len(ctls) else None)
        for ctl in ctls:
            self._recv(ctl)

    def _recv(self, conn: Connection) -> Any:
        if not conn.poll(_START_TIMEOUT_S):
            raise RuntimeError("cpp group: a member did not start in time")
        return conn.recv()

    def prefill(self, request_id: str, prompt: list[int], *, max_tokens: int = 16,
                kv_target: KvTarget | None = None) -> CppResult:
        """Run one prompt through the group; its first token and the time to it."""
        self._head.send(CppBegin(request_id, tuple(prompt), max_tokens, kv_target))
        t0 = time.perf_counter()
        for start, n in chunks(len(prompt), self.chunk_tokens):
            self._head.send(CppChunk(request_id, start, n, -1))
        token: CppFirstToken | None = None
        ttft = 0.0
        done: dict[int, CppDone] = {}
        while token is None or len(done) < len(self._procs):
            msg = self._tail.recv()
            if isinstance(msg, CppFirstToken):
                token, ttft = msg, time.perf_counter() - t0
            elif isinstance(msg, CppDone):
                done[msg.member] = msg
        return CppResult(token.token, ttft, tuple(done[m].compute_s for m in sorted(done)),
                         tuple(done[m].kv_bytes for m in sorted(done)))

    def close(self) -> None:
        self._head.send(CppStop())
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive() and not isinstance(proc, threading.Thread):
                proc.terminate()

    def __enter__(self) -> CppGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

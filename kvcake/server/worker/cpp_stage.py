"""One member of a chunked-pipeline-parallel (CPP) prefill group, live.

A CPP group is X prefill workers in pipeline order; member s runs `StageEngine` over its slice of
the layers (`split_layers(num_layers, X)[s]`). A prompt is cut into chunks of `chunk_tokens`
(>= 1,000 in serving, configurable) that flow member to member: member s computes chunk i while
member s-1 computes chunk i+1.

Hidden states move through the transfer engine: every member but the first serves an inbox, a
shared-memory transfer segment of `slots` chunk-sized slots (`cpp-hidden-<tag>`); member s-1
WRITEs chunk i's hidden states into a free slot (a memcpy on one host, TCP across hosts) and
then sends `CppChunk(slot)`; member s answers `CppSlotFree(slot)` once its forward has read it
(layer 0 consumes it), so `slots` = 2 is double buffering and a slow member back-pressures the
one before it.

Control messages travel along the chain: `up` is the connection from the member before (the
group's driver for member 0), `down` the one to the member after (the driver for the last). The
driver sends `CppBegin` and then every `CppChunk` (slot -1: member 0 embeds the tokens itself);
each member forwards `CppBegin` and its chunks down; the last member answers `CppFirstToken`.
`up` / `down` are anything with `send(obj)`, `recv()` and `poll()` (multiprocessing pipes here).

KV: each member streams its own layers' KV of each chunk, layer by layer from the layer hook,
straight into the decode engine's reserved blocks (`CppBegin.kv_target`, the decode pool's
segment, `KVPool.layer_offset_bytes` with the decoder layer index), and waits for its writes
before it reports the request done. A prefix reused from the store: `import_prefix` puts this
member's layers of its whole stored blocks into its pool, `stream_prefix` writes them to the
decode engine's blocks, and the chunks start after it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvcake.engine.sampling import SamplingParams
from kvcake.engine.stage import StageEngine
from kvcake.server.worker.kv_runs import block_runs
from kvcake.transfer import (
    SegmentDesc,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
)
from kvcake.transfer.request import BatchId

_TRANSFER_TIMEOUT_S = 30.0


class Channel(Protocol):
    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def poll(self, timeout: float | None = ...) -> bool: ...


@dataclass(frozen=True)
class KvTarget:
    """Where a request's prompt KV goes: the decode pool segment (as a dict, `SegmentDesc`'s
    `to_dict`), its number of blocks and the target block of every prompt block (-1: the decode
    side already caches it)."""

    kv_pool: dict[str, Any]
    num_pool_blocks: int
    target_blocks: tuple[int, ...]


@dataclass(frozen=True)
class CppBegin:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int = 16
    kv_target: KvTarget | None = None


@dataclass(frozen=True)
class CppChunk:
    request_id: str
    start: int
    num_tokens: int
    slot: int  # the receiver's inbox slot holding the hidden states; -1: none (member 0)


@dataclass(frozen=True)
class CppSlotFree:
    slot: int


@dataclass(frozen=True)
class CppFirstToken:
    request_id: str
    token: int
    compute_s: float  # this (last) member's forward time for the request


@dataclass(frozen=True)
class CppDone:
    """A member finished a request (its KV writes are complete); sent down the chain."""

    request_id: str
    member: int
    compute_s: float
    kv_bytes: int


@dataclass(frozen=True)
class CppStop:
    pass


def chunks(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a prompt."""
    if chunk_tokens < 1:
        raise ValueError(f"cpp chunk tokens: must be >= 1, got {chunk_tokens}")
    return [(s, min(chunk_tokens, num_tokens - s)) for s in range(0, num_tokens, chunk_tokens)]


@dataclass
class _Request:
    begin: CppBegin
    kv_pool: SegmentDesc | None
    batches: list[BatchId] = field(default_factory=list)
    compute_s: float = 0.0
    kv_bytes: int = 0


class CppMember:
    """One group member: owns the stage engine and its inbox segment. The steps (`begin`,
    `compute`, `write_hidden`, `finish`, `abort`) are what both drivers use: `run` over pipes
    (`CppGroup`), and a live worker's role (cpp_role.py) over its frontend link."""

    def __init__(self, stage: StageEngine, transfer: TransferEngine, *, member: int,
                 chunk_tokens: int, slots: int = 2, tag: str = "") -> None:
        if slots < 1:
            raise ValueError(f"cpp slots: must be >= 1, got {slots}")
        self.stage = stage
        self.transfer = transfer
        self.member = member
        self.slots = slots
        itemsize = torch.empty((), dtype=stage.dtype).element_size()
        self.slot_bytes = chunk_tokens * stage.hidden_size * itemsize
        self.chunk_tokens = chunk_tokens
        self.inbox: SegmentDesc | None = None
        self._inbox_name = f"cpp-hidden-{tag or member}"
        if not stage.is_first:
            self.inbox = transfer.allocate_segment(self._inbox_name, slots * self.slot_bytes)
        self._next: SegmentDesc | None = None
        self._free_next = list(range(slots))
        self._requests: dict[str, _Request] = {}

    def connect_next(self, inbox: SegmentDesc) -> None:
        """The next member's inbox (none for the last member)."""
        self._next = inbox

    def _hidden_in(self, slot: int, num_tokens: int) -> torch.Tensor:
        view = self.transfer.local_view(self._inbox_name, slot * self.slot_bytes, self.slot_bytes)
        flat = torch.frombuffer(view, dtype=self.stage.dtype)
        return flat[:num_tokens * self.stage.hidden_size].view(num_tokens, self.stage.hidden_size)

    # -- the steps -----------------------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def begin(self, msg: CppBegin, params: SamplingParams | None = None) -> bool:
        """Allocate the request's blocks in this stage; False when its pool has no room."""
        if not self.stage.begin(msg.request_id, msg.prompt,
                                params or SamplingParams(max_tokens=msg.max_tokens)):
            return False
        target = msg.kv_target
        self._requests[msg.request_id] = _Request(
            msg, None if target is None else SegmentDesc.from_dict(target.kv_pool))
        return True

    def compute(self, msg: CppChunk) -> torch.Tensor | int | None:
        """Run one chunk (its hidden states from inbox slot `msg.slot`; -1: stage 0 embeds the
        tokens), streaming this stage's layers of its KV. Returns the hidden states for the next
        stage, or on the last stage the first token once the prompt is in (else None). The
        inbox slot may be written again once this returns."""
        req = self._requests[msg.request_id]
        hidden = None if msg.slot < 0 else self._hidden_in(msg.slot, msg.num_tokens)
        bs = self.stage.block_size
        first_block, end_block = msg.start // bs, -(-(msg.start + msg.num_tokens) // bs)

        def hook(layer: int) -> None:
            self._stream_layer(req, layer, first_block, end_block)

        t0 = time.perf_counter()
        out = self.stage.run_chunk(msg.request_id, msg.start, msg.num_tokens, hidden,
                                   hook if req.kv_pool is not None else None)
        req.compute_s += time.perf_counter() - t0
        if self.stage.is_last:
            return out if isinstance(out, int) else None
        assert isinstance(out, torch.Tensor)
        return out

    def import_prefix(self, request_id: str, blocks: Sequence[bytes | bytearray]) -> None:
        """Put this stage's layers of the request's first `len(blocks)` prompt blocks into its
        pool: each block either whole as the store holds it (every layer's K|V, layer order) or
        only this stage's layers of it (its slice object, block_fetch.read_layers); a prefix
        reused from the store, so the chunks start after it."""
        pool, layers = self.stage.pool, self.stage.layers
        whole = pool.layer_nbytes * self.stage.model_config.num_layers
        mine = pool.layer_nbytes * len(layers)
        block_ids = self.stage.block_ids(request_id)
        if len(blocks) > len(block_ids):
            raise ValueError(f"prefix: {len(blocks)} blocks for a prompt of {len(block_ids)}")
        count = pool.layer_nbytes // pool.kv.element_size()
        for block_id, data in zip(block_ids, blocks, strict=False):
            if len(data) not in (whole, mine):
                raise ValueError(f"prefix: a block is {whole} bytes (this stage's layers: "
                                 f"{mine}), got {len(data)}")
            first = layers.start if len(data) == whole else 0
            for local in range(len(layers)):
                src = torch.frombuffer(data, dtype=self.stage.dtype, count=count,
                                       offset=(first + local) * pool.layer_nbytes)
                pool.kv[local, block_id].copy_(src.view(pool.layer_shape))

    def stream_prefix(self, request_id: str, end_block: int) -> None:
        """This stage's layers of the request's first `end_block` blocks (a reused prefix: no
        chunk computes them here) into the decode pool's reserved blocks."""
        req = self._requests[request_id]
        if req.kv_pool is None or end_block <= 0:
            return
        for layer in self.stage.layers:
            self._stream_layer(req, layer, 0, end_block)

    def is_final(self, msg: CppChunk) -> bool:
        return msg.start + msg.num_tokens == len(self._requests[msg.request_id].begin.prompt)

    def write_hidden(self, out: torch.Tensor, slot: int, inbox: SegmentDesc | None = None) -> None:
        """A chunk's hidden states into slot `slot` of the next stage's inbox (`inbox`, else the
        connected one)."""
        target = inbox or self._next
        assert target is not None
        self.transfer.write(target, slot * self.slot_bytes,
                            out.contiguous().view(torch.uint8).numpy().reshape(-1))

    def finish(self, request_id: str, release: bool = True) -> CppDone:
        """Wait for this stage's KV writes of the request, free its blocks (`release` False:
        the caller frees them, `stage.release`, once it has read them; also on an error)."""
        req = self._requests.pop(request_id)
        try:
            for batch in req.batches:
                self.transfer.wait(batch, _TRANSFER_TIMEOUT_S).raise_for_failure()
        finally:
            if release:
                self.stage.release(request_id)
        return CppDone(request_id, self.member, req.compute_s, req.kv_bytes)

    def abort(self, request_id: str) -> None:
        """Drop a request: once this returns nothing of it writes the decode pool any more."""
        if request_id not in self._requests:
            return
        try:
            self.finish(request_id)
        except TransferError:
            pass  # the writes ended (failed): nothing writes any more either way

    # -- driven over pipes (`CppGroup`) --------------------------------------------------------
    def run(self, up: Channel, down: Channel) -> None:
        """Serve until `CppStop` (forwarded down)."""
        while True:
            msg = up.recv()
            if isinstance(msg, CppStop):
                down.send(msg)
                return
            self.handle(msg, up, down)

    def handle(self, msg: Any, up: Channel, down: Channel) -> None:
        if isinstance(msg, CppBegin):
            if not self.begin(msg):
                raise RuntimeError(f"cpp member {self.member}: no KV room for "
                                   f"{msg.request_id} ({len(msg.prompt)} tokens)")
            if not self.stage.is_last:
                down.send(msg)
        elif isinstance(msg, CppChunk):
            self._chunk(msg, up, down)
        elif isinstance(msg, CppDone):  # an earlier member's report, on its way to the driver
            down.send(msg)
        else:
            raise ValueError(f"cpp member {self.member}: unexpected message {msg!r}")

    def _chunk(self, msg: CppChunk, up: Channel, down: Channel) -> None:
        final = self.is_final(msg)
        out = self.compute(msg)
        if msg.slot >= 0:
            up.send(CppSlotFree(msg.slot))
        if isinstance(out, torch.Tensor):
            slot = self._take_slot(down)
            self.write_hidden(out, slot)
            down.send(CppChunk(msg.request_id, msg.start, msg.num_tokens, slot))
        elif out is not None:
            compute_s = self._requests[msg.request_id].compute_s
            down.send(CppFirstToken(msg.request_id, out, compute_s))
        if final:
            down.send(self.finish(msg.request_id))

    def _take_slot(self, down: Channel) -> int:
        """A free slot of the next member's inbox, waiting for one to come back if needed."""
        while down.poll(0) or not self._free_next:
            msg = down.recv()
            if not isinstance(msg, CppSlotFree):
                raise ValueError(f"cpp member {self.member}: unexpected {msg!r} from the next")
            self._free_next.append(msg.slot)
        return self._free_next.pop(0)

    def _stream_layer(self, req: _Request, layer: int, first_block: int, end_block: int) -> None:
        target = req.begin.kv_target
        assert target is not None and req.kv_pool is not None
        block_ids = self.stage.block_ids(req.begin.request_id)
        local = layer - self.stage.layers.start
        pool = self.stage.pool
        runs = block_runs(block_ids, target.target_blocks, first_block, end_block)
        requests = [
            TransferRequest(TransferOp.WRITE, pool.kv[local, src:src + n], req.kv_pool,
                            (layer * target.num_pool_blocks + dst) * pool.layer_nbytes,
                            checksum_tcp=True)
            for src, dst, n in runs]
        if requests:
            req.batches.append(self.transfer.submit(requests))
            req.kv_bytes += sum(n for _, _, n in runs) * pool.layer_nbytes

"""The per-request objects of the disaggregated backend: a request in flight and the KV
streaming totals.

A `Flight` is created by `DisaggBackend.generate` and lives until its `Stage` is DONE; only
`Flights` (flights.py) mutates it, under the backend's lock. What the HTTP side iterates is a
`backend.QueueTokenStream` over the flight's sink: it yields `TokenEvent`s and raises the error
a failed flight puts there.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, cast

from kvcake.conductor import Placement
from kvcake.server.frontend.backend import GenerateRequest, TokenEvent
from kvcake.server.worker.messages import (
    CppOrder,
    DecodeOrder,
    PrefillDone,
    PrefillOrder,
    Sampling,
)


class Stage(Enum):
    QUEUED = "queued"  # placed, not yet sent anywhere
    RESERVING = "reserving"  # waiting for its decode worker to reserve KV blocks
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"


@dataclass
class Flight:
    request: GenerateRequest
    sink: asyncio.Queue[TokenEvent | BaseException]
    loop: asyncio.AbstractEventLoop
    placement: Placement
    sampling: Sampling
    # The decode engine's KV blocks each prompt block is written to (-1: cached there already).
    targets: list[int] = field(default_factory=list)
    kv_pool: dict[str, Any] = field(default_factory=dict)  # the decode worker's pool segment
    num_pool_blocks: int = 0
    reserved: bool = False  # the decode worker holds (or is making) an uncommitted reservation
    prefill_writing: bool = False  # the prefill order is out and its worker has not answered
    kv_kept: bool = False  # the reservation is never handed back (its writer was lost mid-write)
    stage: Stage = Stage.QUEUED
    num_cached_tokens: int = 0
    aborted: bool = False
    # A CPP placement: the stages still to answer (PrefillDone or RequestFailed), the last
    # stage's PrefillDone (the first token) and the KV bytes every stage streamed.
    cpp_waiting: set[str] = field(default_factory=set)
    cpp_done: PrefillDone | None = None
    cpp_transfer_bytes: int = 0

    @property
    def prefill_ids(self) -> tuple[str, ...]:
        """The prefill worker, or every stage of a CPP group."""
        return self.placement.prefill_group or (self.placement.prefill_id,)

    def prefill_order(self, layer_bounds: list[int] | None = None) -> PrefillOrder:
        """The order for the prefill worker: write into `targets` of the decode worker's pool
        (no targets: the request decodes where it prefills). `layer_bounds`: the layer slices a
        CPP group stores blocks in (a fetch may read those)."""
        fetch = self.placement.fetch
        request = self.request
        return PrefillOrder(request.request_id, list(request.prompt_token_ids),
                            asdict(self.sampling),
                            [cast(int, k) for k in fetch.keys] if fetch is not None else [],
                            self.kv_pool, self.targets, self.num_pool_blocks,
                            list(layer_bounds or []) if fetch is not None else [])

    def cpp_order(self, next_inbox: dict[str, Any]) -> CppOrder:
        """The order for one stage of the request's CPP group (`next_inbox`: the next stage's
        inbox segment, {} for the last)."""
        request, fetch = self.request, self.placement.fetch
        return CppOrder(request.request_id, list(request.prompt_token_ids), asdict(self.sampling),
                        next_inbox, self.kv_pool, self.targets, self.num_pool_blocks,
                        [cast(int, k) for k in fetch.keys] if fetch is not None else [])

    def decode_order(self, first_token_id: int,
                     sampler_state: bytes | None = None) -> DecodeOrder:
        return DecodeOrder(self.request.request_id, list(self.request.prompt_token_ids),
                           first_token_id, asdict(self.sampling), sampler_state)
        # (a CPP group's prompt: its stages store it, cpp_role.py; not the decode worker)

    def emit(self, item: TokenEvent | BaseException) -> None:
        """Hand an event (or the error that ends the stream) to the HTTP side; any thread."""
        try:
            self.loop.call_soon_threadsafe(self.sink.put_nowait, item)
        except RuntimeError:  # the HTTP side's loop is closed: nobody listens any more
            pass


@dataclass
class TransferTotals:
    """KV streaming figures summed over finished prefills (see `PrefillDone`)."""

    num_prefills: int = 0
    compute_s: float = 0.0
    transfer_span_s: float = 0.0
    transfer_exposed_s: float = 0.0
    transfer_bytes: int = 0
    num_cached_tokens: int = 0
    num_fetched_tokens: int = 0

    @property
    def hidden_share(self) -> float:
        """Share of the streaming window overlapped with compute: 1 - exposed / span."""
        if self.transfer_span_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.transfer_exposed_s / self.transfer_span_s)

    def add(self, done: PrefillDone) -> None:
        self.num_prefills += 1
        self.compute_s += done.compute_s
        self.transfer_span_s += done.transfer_span_s
        self.transfer_exposed_s += done.transfer_exposed_s
        self.transfer_bytes += done.transfer_bytes
        self.num_cached_tokens += done.num_cached_tokens
        self.num_fetched_tokens += done.num_fetched_tokens


def sampling_of(request: GenerateRequest) -> Sampling:
    """The request's sampling settings as an order carries them (prefill and decode engines get
    the same: the prefill side masks the first token, the decode side counts it)."""
    return Sampling(max_tokens=request.max_tokens, temperature=request.temperature,
                    top_p=request.top_p, top_k=request.top_k, seed=request.seed,
                    stop_token_ids=list(request.stop_token_ids), ignore_eos=request.ignore_eos,
                    min_tokens=request.min_tokens, repetition_penalty=request.repetition_penalty,
                    frequency_penalty=request.frequency_penalty,
                    presence_penalty=request.presence_penalty, min_p=request.min_p,
                    logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs)

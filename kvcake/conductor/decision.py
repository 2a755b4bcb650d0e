"""What goes into the Conductor (`ScheduleRequest`) and what comes out (`Placement` | `Rejection`).

Plain frozen data, so the simulator and the live frontend consume decisions the same way and a
user can read why a request went where it went: every decision carries a per-candidate breakdown.

Block keys are opaque hashables: `BlockKey` ints in the live cluster, trace `hash_ids` in the
simulator. Token counts (`*_len`) are tokens, not blocks.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

Holder = str
"""Who holds a copy of a block: a prefill instance id, or a store tier name such as "store"."""


@dataclass(frozen=True)
class ScheduleRequest:
    """One request to place.

    block_keys: chained prefix keys of the prompt's blocks, in order (a trailing partial block may
        have a key, as in Mooncake traces; it counts as `prompt_len - (n - 1) * block_size` tokens).
    max_output_len: tokens the request will (at most) generate; drives the decode-load forecast.
    """

    request_id: str
    prompt_len: int
    block_keys: tuple[Hashable, ...]
    block_size: int
    max_output_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_keys, tuple):
            object.__setattr__(self, "block_keys", tuple(self.block_keys))
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.block_size < 1:
            raise ValueError(f"request {self.request_id}: block_size must be >= 1, got {self.block_size}")
        if self.max_output_len < 1:
            raise ValueError(f"request {self.request_id}: max_output_len must be >= 1, "
                             f"got {self.max_output_len}")
        if len(self.block_keys) * self.block_size > self.prompt_len + self.block_size - 1:
            raise ValueError(f"request {self.request_id}: {len(self.block_keys)} block keys of "
                             f"{self.block_size} tokens exceed prompt_len {self.prompt_len}")

    def tokens_of_blocks(self, num_blocks: int) -> int:
        """Tokens covered by the first `num_blocks` blocks (the last one may be partial)."""
        return min(num_blocks * self.block_size, self.prompt_len)


@dataclass(frozen=True)
class FetchPlan:
    """Fetch the KVCache of `keys` (tokens `start_len`..`end_len`) from `source` before prefill.

    The prefill instance keeps what it fetched: hot prefixes are replicated as a side effect of
    routing. The caller reports the new replica with `on_blocks_stored` (or the Conductor records
    it at placement when `index_on_placement` is set) and the end of the transfer with
    `on_transfer_done`.
    """

    source: Holder
    keys: tuple[Hashable, ...]
    start_len: int
    end_len: int
    num_bytes: int
    transfer_s: float

    @property
    def num_tokens(self) -> int:
        return self.end_len - self.start_len


class PrefillEstimate(NamedTuple):
    """One prefill candidate as the policy saw it (a NamedTuple: built 64 times per decision).

    local_len: prefix tokens the instance holds itself. prefix_len: prefix tokens the prefill
    would reuse (local_len, or the fetched best_len). ttft_s = transfer_s + queue_s + prefill_s.
    """

    instance_id: str
    local_len: int
    prefix_len: int
    transfer_s: float
    queue_s: float
    prefill_s: float

    @property
    def ttft_s(self) -> float:
        return self.transfer_s + self.queue_s + self.prefill_s


class DecodeEstimate(NamedTuple):
    """One decode candidate: its predicted batch when this request joins, and the step time (TBT)."""

    instance_id: str
    batch_size: int
    context_tokens: int
    tbt_s: float


class RejectReason(StrEnum):
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    NO_INSTANCE = "no_instance"


@dataclass(frozen=True)
class Placement:
    """Run the prefill on `prefill_id` (after `fetch`, if any) and decode on `decode_id`.

    prefix_len: prompt tokens whose KVCache is reused (never the last prompt token, whose logits
    give the first output token). In COLOCATED mode prefill_id == decode_id.
    prefill_group: with chunked pipeline parallelism (CPP), the prefill instances that pipeline
    this prompt's chunks, in pipeline order (`prefill_group[0] == prefill_id`; the candidates and
    the fetch plan are the group's, under that id); empty for a prompt prefilled by one instance.
    The Conductor's placements build `prefill_candidates` on first access (the same values; see
    `LazyPrefillCandidates`): most callers never read them.
    """

    request_id: str
    prefill_id: str
    decode_id: str
    prefix_len: int
    fetch: FetchPlan | None
    predicted_ttft_s: float
    predicted_tbt_s: float
    prefill_candidates: tuple[PrefillEstimate, ...]
    decode_candidates: tuple[DecodeEstimate, ...]
    prefill_group: tuple[str, ...] = ()

    @property
    def chosen(self) -> PrefillEstimate:
        return next(c for c in self.prefill_candidates if c.instance_id == self.prefill_id)

    @classmethod
    def _with_lazy_candidates(cls, prefill_candidates: LazyPrefillCandidates,
                              **fields: object) -> Placement:
        """The Conductor's constructor: `prefill_candidates` is expanded on first access.

        Every other field is passed by name, as to `Placement(...)`. Until expanded, the
        placement's `__dict__` holds the compact form instead of the field; the expanded
        tuple is then stored as the plain attribute (equality, repr, hash, pickling and
        `dataclasses` helpers all read it through attribute access, so they see the same values).
        """
        placement = object.__new__(cls)
        placement.__dict__.update(fields)
        placement.__dict__[_LAZY] = prefill_candidates
        return placement

    if not TYPE_CHECKING:  # hidden from mypy, which would otherwise accept any attribute name

        def __getattr__(self, name: str) -> Any:
            # Only called when normal lookup fails, i.e. for a not yet expanded candidate tuple.
            lazy = self.__dict__.get(_LAZY) if name == "prefill_candidates" else None
            if lazy is None:
                raise AttributeError(f"'Placement' object has no attribute {name!r}")
            value = lazy.expand()
            object.__setattr__(self, "prefill_candidates", value)
            self.__dict__.pop(_LAZY, None)  # (two threads may both expand: same values)
            return value


_LAZY = "_lazy_prefill_candidates"


class LazyPrefillCandidates:
    """The prefill candidates of one decision in compact form, expanded on demand.

    A decision carries one `PrefillEstimate` per prefill instance. Few callers read them, but a
    caller that keeps its placements for the request's lifetime (the live frontend does) would
    keep ~64 small tracked objects per request alive: the cyclic garbage collector's work, and
    the slowest 1% of decisions were the ones that paid for its passes. Here one decision holds
    three tuples of atoms (which the collector untracks) whatever the pool size. Instances that
    hold the same prefix share one plan `(local_len, prefix_len, transfer_s, prefill_s, ...)`;
    only the queue differs.
    """

    __slots__ = ("instance_ids", "plans", "queue_s")

    def __init__(self, instance_ids: tuple[str, ...], plans: tuple[tuple[Any, ...], ...],
                 queue_s: tuple[float, ...]) -> None:
        self.instance_ids, self.plans, self.queue_s = instance_ids, plans, queue_s

    def __len__(self) -> int:
        return len(self.instance_ids)

    def __getitem__(self, index: int) -> PrefillEstimate:
        plan = self.plans[index]
        return PrefillEstimate(self.instance_ids[index], plan[0], plan[1], plan[2],
                               self.queue_s[index], plan[3])

    def expand(self) -> tuple[PrefillEstimate, ...]:
        new = tuple.__new__  # what PrefillEstimate(...) does, without its Python-level __new__
        return tuple([new(PrefillEstimate, (instance_id, plan[0], plan[1], plan[2], queue_s,
                                            plan[3]))
                      for instance_id, plan, queue_s in zip(self.instance_ids, self.plans,
                                                            self.queue_s, strict=True)])


@dataclass(frozen=True)
class Rejection:
    """Answer 429 with Retry-After `retry_after_s` (an estimate); nothing was booked."""

    request_id: str
    reason: RejectReason
    retry_after_s: float
    predicted_ttft_s: float
    predicted_tbt_s: float
    prefill_candidates: tuple[PrefillEstimate, ...]
    decode_candidates: tuple[DecodeEstimate, ...]


Decision = Placement | Rejection

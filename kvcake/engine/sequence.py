"""The state of one request inside an engine: its tokens, progress and status. Pure.

Token regions of a sequence (B = block_size):

  |<------------------- num_tokens = prompt + output -------------------->|
  |<---- num_computed_tokens (KV written) ---->|<- scheduled next step ->|
  |<- num_cached_tokens ->|  (KV reused from the prefix cache at admission)
  |<- full blocks: one key each ->|partial|

A decoding sequence has exactly one uncomputed token: the one it sampled last.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvcake.hashing import hash_block, namespace_seed
from kvcake.types import BlockKey, RequestId


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token (or EOS) was sampled
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # abort() was called
    PREFILL_DONE = "prefill_done"  # prefill-only request produced its first token


@dataclass
class Sequence:
    request_id: RequestId
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    block_size: int
    namespace: str
    prefill_only: bool = False
    reuse_prefix: bool = True  # False: admission computes the whole prompt (prompt logprobs)
    arrival_s: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # set at first admission
    first_scheduled_s: float | None = None  # clock time of the step that first scheduled it
    first_token_s: float | None = None
    finish_reason: FinishReason | None = None
    block_keys: list[BlockKey] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.update_block_keys()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def admission_keys(self) -> list[BlockKey]:
        """The block keys admission may reuse from the prefix cache (none without reuse)."""
        return self.block_keys if self.reuse_prefix else []

    def update_block_keys(self) -> None:
        """Extend `block_keys` to every full block of `token_ids` (incremental, chained)."""
        bs = self.block_size
        parent = self.block_keys[-1] if self.block_keys else namespace_seed(self.namespace)
        for start in range(len(self.block_keys) * bs, self.num_tokens - bs + 1, bs):
            parent = hash_block(parent, self.token_ids[start:start + bs])
            self.block_keys.append(parent)

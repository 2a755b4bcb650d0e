"""What a worker and its role (`prefill.PrefillRole`, `decode.DecodeRole`) need of each other.

The worker owns the engine, the transfer engine, the store client and the frontend link; a role
decides what to do with the orders that arrive. `RoleHost` is the worker as a role sees it and
`WorkerRole` the role as the worker drives it (all on the engine-loop thread, except `start` /
`close`), so the roles import this module, not `worker.py`, and `worker.py` imports the roles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvcake.engine.sampling import SamplingParams
from kvcake.server.worker.config import WorkerConfig
from kvcake.server.worker.messages import Message, Sampling

if TYPE_CHECKING:
    from kvcake.engine.engine import Engine
    from kvcake.store import StoreClient
    from kvcake.transfer import TransferEngine


class RoleHost(Protocol):
    """The worker as its role sees it (`worker.Worker`)."""

    config: WorkerConfig
    worker_id: str
    engine: Engine | None
    transfer: TransferEngine | None
    store: StoreClient | None

    def send(self, message: Message) -> None:
        """To the connected frontend; dropped when there is none."""

    def send_many(self, messages: list[Message]) -> None:
        """`send` of each, in order, as one write to the link."""

    def post(self, item: object) -> None:
        """Hand a role-internal item to the engine-loop thread (it comes back to `handle`)."""


class WorkerRole(Protocol):
    """A role as the worker drives it."""

    def start(self) -> None: ...

    def close(self) -> None: ...

    def has_pending(self) -> bool: ...

    def num_pending(self) -> int: ...

    def handle(self, message: Any) -> None: ...

    def step(self) -> None: ...

    def after_step(self) -> None: ...


def wire_logprobs(raw: list[Any] | None) -> list[Any] | None:
    """An engine output's log probabilities as the wire carries them (plain lists)."""
    if raw is None:
        return None
    return [[t, lp, [list(pair) for pair in top]] for t, lp, top in raw]


def sampling_params(sampling: Sampling) -> SamplingParams:
    """The engine's sampling parameters of an order's wire `Sampling`."""
    return SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                          top_k=sampling.top_k or None, top_p=sampling.top_p, seed=sampling.seed,
                          stop_token_ids=tuple(sampling.stop_token_ids),
                          ignore_eos=sampling.ignore_eos, min_tokens=sampling.min_tokens,
                          repetition_penalty=sampling.repetition_penalty,
                          frequency_penalty=sampling.frequency_penalty,
                          presence_penalty=sampling.presence_penalty, min_p=sampling.min_p,
                          logprobs=sampling.logprobs,
                          prompt_logprobs=sampling.prompt_logprobs)

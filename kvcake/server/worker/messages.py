"""Typed control messages between the frontend and its workers, and their codec.

Control messages are small msgpack maps in the store's length-prefixed frames
(`kvcake.store.protocol`: u32 big-endian length | msgpack body), carried by a `MessageLink`
(`link.py`); bulk KV never travels here, only through the transfer engine. A body is `{"type": <class name>, <field>: <value>, ...}`.
`decode` checks the type tag and every field (names and value types) and raises
`MessageError` (a ValueError) naming what is wrong; a connection that sent a bad frame is out
of sync and is closed by its reader.

Direction and meaning (F = frontend, P = prefill worker, D = decode worker):
  P/D -> F  Hello          the worker's identity and KV layout (on connect)
  F -> D    ReserveKv      reserve the request's KV blocks in D's engine
  D -> F    KvReserved     D's pool segment and the reserved block ids (or RequestFailed)
  F -> P    PrefillOrder   fetch the planned prefix, prefill, stream KV into D's blocks
  P -> F    PrefillStarted P's engine scheduled the prompt's first chunk: the Conductor's queue
                           counts the prefill's predicted time down from now, not from the order
  P -> F    PrefillDone    first token, cached/fetched tokens, overlap and fetch figures
                           (or an error)
  F -> D    DecodeOrder    commit the reserved blocks, join continuous batching
  D -> F    DecodeAdmitted the request decodes
  D -> F    Tokens         new tokens of a decoding request (finish_reason on the last)
  P/D -> F  RequestFailed  the request cannot continue on this worker
  P/D -> F  KvEvents       blocks stored in / removed from the worker's prefix cache
  P -> F    StoreEvents    blocks written to the store (holder "store" in the Conductor)
  P/D -> F  LoadReport     queue, running requests and free KV blocks
  F -> P/D  Ping           liveness probe; the worker's engine loop answers between steps
  P/D -> F  Pong           the answer (same seq): a worker whose loop stalls stops answering
  F -> P/D  Abort, Shutdown
CPP group members (C; stage s of a chunked-pipeline-parallel group, server/worker/cpp_role.py):
  F -> C    CppOrder       the request and where its KV goes, to every member at once
  C -> F    CppHidden      stage s wrote a chunk's hidden states into stage s+1's inbox slot;
                           the frontend relays it to s+1
  C -> F    CppSlotFree    stage s+1 read that slot; relayed to s (back-pressure)
  C -> F    PrefillDone    a member's KV writes are done (the last stage's carries the first
                           token; the others' first_token_id is -1)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


class MessageError(ValueError):
    """A frame that is not a well-formed message of a known type."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings carried with an order (the engine's SamplingParams, as plain data)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens exist
    repetition_penalty: float = 1.0  # vLLM's extras (engine/sampling.py); neutral defaults
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None  # top log probabilities per token (None: none)
    prompt_logprobs: int | None = None  # the same per prompt token (the whole prompt computed)


@dataclass(frozen=True)
class Hello:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    model_name: str
    namespace: str
    block_size: int
    num_blocks: int
    block_nbytes: int
    layer_nbytes: int
    num_layers: int
    kv_bytes_per_token: int
    max_model_len: int
    vocab_size: int
    cpp_member: int | None = None  # a CPP member's stage in its group
    cpp_inbox: dict[str, Any] | None = None  # its inbox segment (SegmentDesc.to_dict()), stage > 0


@dataclass(frozen=True)
class PrefillOrder:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # Sampling as a map
    fetch_keys: list[int]  # block keys to fetch from the store before prefill (may be empty)
    kv_pool: dict[str, Any]  # SegmentDesc.to_dict() of the decode engine's KV pool ({}: none)
    target_blocks: list[int]  # d's block for each prompt block, in order; -1: skip it.
    # Empty: a colocated request, decoded where it is prefilled.
    num_pool_blocks: int = 0  # blocks of that pool (`KVPool` layout: layer l of block b at
    # (l*N + b) * layer_nbytes); >= 1 whenever `target_blocks` is not empty
    # The layer slices a CPP group stores a block in, as bounds [0, .., num_layers] ([]: none):
    # a fetched block not stored whole is read as those slices (block_fetch.read_layers)
    fetch_layer_bounds: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PrefillStarted:
    request_id: str


@dataclass(frozen=True)
class PrefillDone:
    request_id: str
    first_token_id: int
    finish_reason: str | None  # set when the request ended at its first token
    num_cached_tokens: int  # prompt tokens reused (local pages + fetched)
    num_fetched_tokens: int  # of those, tokens fetched from the store
    compute_s: float  # the prefill steps' wall time
    transfer_span_s: float  # first layer submitted -> last layer landed
    transfer_exposed_s: float  # waited after the last step: the part not hidden by compute
    transfer_bytes: int
    sampler_state: bytes | None = None  # a seeded sampler's state after the first token
    logprobs: list[Any] | None = None  # [[token, logprob, [[id, logprob], ...]]] if asked
    fetch_bytes: int = 0  # bytes the prefix fetch read from the store (0: no fetch)
    fetch_s: float = 0.0  # the fetch's wall time: the Conductor's measured loading speed
    # per prompt token if asked: null for the first, then [token, logprob, top pairs]
    prompt_logprobs: list[Any] | None = None


@dataclass(frozen=True)
class DecodeOrder:
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: dict[str, Any]  # the KV is in the blocks reserved for it by ReserveKv
    sampler_state: bytes | None = None  # from PrefillDone: seeded sampling continues exactly
    store_prompt: bool = False  # write the prompt's full blocks to the store (the frontend
    # no longer asks: a CPP group's stages store their layers themselves, cpp_role.py)


@dataclass(frozen=True)
class ReserveKv:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]


@dataclass(frozen=True)
class KvReserved:
    request_id: str
    kv_pool: dict[str, Any]  # SegmentDesc.to_dict() of the decode engine's KV pool
    num_pool_blocks: int
    block_ids: list[int]  # prompt blocks P-n..P-1 (leading cached blocks are not listed)


@dataclass(frozen=True)
class DecodeAdmitted:
    request_id: str


@dataclass(frozen=True)
class Tokens:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Any] | None = None  # one [token, logprob, top pairs] per token, if asked


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    message: str


@dataclass(frozen=True)
class KvEvents:
    stored: list[int]
    removed: list[int]


@dataclass(frozen=True)
class StoreEvents:
    stored: list[int]
    # [lo, hi]: a CPP stage stored layers lo..hi-1 of each block (block_fetch.range_key), listed
    # as stored once every layer's slice is in; []: whole blocks
    layers: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class LoadReport:
    num_waiting: int
    num_running: int
    num_free_blocks: int


@dataclass(frozen=True)
class Ping:
    seq: int


@dataclass(frozen=True)
class Pong:
    seq: int


@dataclass(frozen=True)
class Abort:
    """Stop a request. To a decode worker holding an uncommitted reservation for it: cancel
    the reservation (its blocks become free), unless `keep_reserved`, which the frontend sets
    when the prefill worker writing those blocks was lost mid-write: it may be hung rather than
    dead, so the blocks stay out of use until a plain `Abort` for the same request says that
    worker is dead (its process reaped): never overwritten KV."""

    request_id: str
    keep_reserved: bool = False


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class CppOrder:
    """To every member of the CPP group the Conductor placed the request on: prefill it chunk by
    chunk (stage 0 starts at once, the others on each `CppHidden`), write this member's layers
    of the KV into the decode pool's `target_blocks` (as `PrefillOrder`), and hidden states of
    each chunk into `next_inbox` ({} on the last stage)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    next_inbox: dict[str, Any]
    kv_pool: dict[str, Any]
    target_blocks: list[int]
    num_pool_blocks: int
    fetch_keys: list[int] = field(default_factory=list)  # the prefix to read from the store


@dataclass(frozen=True)
class CppHidden:
    request_id: str
    start: int  # prompt tokens start..start+num_tokens-1
    num_tokens: int
    slot: int  # the receiving stage's inbox slot


@dataclass(frozen=True)
class CppSlotFree:
    request_id: str
    slot: int  # NEXT_STAGE_NEW (from the frontend): the next stage (re)joined, all slots free


NEXT_STAGE_NEW = -1


Message = (Hello | PrefillOrder | PrefillStarted | PrefillDone | DecodeOrder | ReserveKv
           | KvReserved | DecodeAdmitted | Tokens
           | RequestFailed | KvEvents | StoreEvents | LoadReport | Ping | Pong | Abort | Shutdown
           | CppOrder | CppHidden | CppSlotFree)

_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    Hello, PrefillOrder, PrefillStarted, PrefillDone, DecodeOrder, ReserveKv, KvReserved,
    DecodeAdmitted, Tokens, RequestFailed,
    KvEvents, StoreEvents, LoadReport, Ping, Pong, Abort, Shutdown, CppOrder, CppHidden,
    CppSlotFree)}

_CHECKS: dict[str, Any] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "list[int]": lambda v: isinstance(v, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v),
    "dict[str, Any]": lambda v: isinstance(v, dict),
    "list[Any]": lambda v: isinstance(v, list),
    "bytes": lambda v: isinstance(v, bytes),
}


def _valid(value: Any, annotation: str) -> bool:
    for option in annotation.split(" | "):
        if option == "None" and value is None:
            return True
        check = _CHECKS.get(option)
        if check is not None and value is not None and check(value):
            return True
    return False


def to_wire(message: Message) -> dict[str, Any]:
    """The message as a plain map (what goes into a frame)."""
    return {"type": type(message).__name__, **asdict(message)}


def from_wire(body: object) -> Message:
    """The message a frame body names; MessageError naming the bad part otherwise."""
    if not isinstance(body, dict):
        raise MessageError("message: a frame must hold a map")
    name = body.get("type")
    cls = _TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise MessageError(f"type: unknown message type {name!r}")
    spec = {f.name: str(f.type) for f in fields(cls)}
    unknown = sorted(set(body) - set(spec) - {"type"}, key=str)
    if unknown:
        raise MessageError(f"{name}: unknown fields {unknown}")
    values = {}
    for fname, annotation in spec.items():
        if fname not in body:
            raise MessageError(f"{name}.{fname}: missing")
        if not _valid(body[fname], annotation):
            raise MessageError(f"{name}.{fname}: expected {annotation}, got "
                               f"{type(body[fname]).__name__}")
        values[fname] = body[fname]
    return cls(**values)  # type: ignore[no-any-return]


def sampling_from_wire(body: dict[str, Any]) -> Sampling:
    """A Sampling from its map; MessageError on unknown or mistyped fields."""
    spec = {f.name: str(f.type) for f in fields(Sampling)}
    unknown = sorted(set(body) - set(spec), key=str)
    if unknown:
        raise MessageError(f"sampling: unknown fields {unknown}")
    for fname, annotation in spec.items():
        if fname in body and not _valid(body[fname], annotation):
            raise MessageError(f"sampling.{fname}: expected {annotation}")
    if "max_tokens" not in body:
        raise MessageError("sampling.max_tokens: missing")
    return Sampling(**body)

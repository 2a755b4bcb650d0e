"""The control-message codec: every type round-trips; malformed bodies are refused by name."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Abort,
    DecodeAdmitted,
    DecodeOrder,
    Hello,
    KvEvents,
    KvReserved,
    LoadReport,
    MessageError,
    Ping,
    Pong,
    PrefillDone,
    PrefillOrder,
    PrefillStarted,
    RequestFailed,
    ReserveKv,
    Sampling,
    Shutdown,
    StoreEvents,
    Tokens,
    from_wire,
    sampling_from_wire,
    to_wire,
)

BIG_KEY = 2**64 - 1  # block keys are unsigned 64-bit

EXAMPLES = [
    Hello("decode-1", "decode", "tiny", "kvcake/tiny/seed0/float32/b16", 16, 100, 65536, 16384,
          4, 4096, 2048, 512),
    PrefillOrder("r1", [1, 2, 3], {"max_tokens": 4}, [BIG_KEY, 7], {}, []),
    PrefillStarted("r1"),
    PrefillDone("r1", 42, None, 16, 16, 0.5, 0.25, 0.001, 4096),
    PrefillDone("r2", 7, "length", 0, 0, 0.1, 0.0, 0.0, 0),
    DecodeOrder("r1", [1, 2, 3], 42, {"max_tokens": 4, "temperature": 0.5}),
    PrefillOrder("r1", [1, 2, 3], {"max_tokens": 4}, [], {"name": "kv-pool"}, [-1, 17], 300),
    DecodeOrder("r1", [1, 2, 3], 42, {"max_tokens": 4}, b"\x01state"),
    ReserveKv("r1", [1, 2, 3], {"max_tokens": 4}),
    KvReserved("r1", {"name": "kv-pool-d"}, 300, [17]),
    KvReserved("r2", {"name": "kv-pool-d"}, 300, []),
    DecodeAdmitted("r1"),
    Tokens("r1", [5, 6], None),
    Tokens("r1", [], "stop"),
    Tokens("r1", [5], None, [[5, -0.5, [[5, -0.5], [6, -1.25]]]]),
    RequestFailed("r1", "boom"),
    KvEvents([BIG_KEY, 1], []),
    StoreEvents([3]),
    LoadReport(1, 2, 3),
    Ping(1),
    Pong(2**40),
    Abort("r9"),
    Shutdown(),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_through_msgpack(message: object) -> None:
    body = msgpack.unpackb(msgpack.packb(to_wire(message), use_bin_type=True),  # type: ignore[arg-type]
                           raw=False, strict_map_key=False)
    assert from_wire(body) == message


def test_wire_form_names_the_type_and_fields() -> None:
    assert to_wire(Tokens("r1", [5], "stop")) == {"type": "Tokens", "request_id": "r1",
                                                   "token_ids": [5], "finish_reason": "stop",
                                                   "logprobs": None}


@pytest.mark.parametrize(("body", "error"), [
    ([1, 2], "a frame must hold a map"),
    ({"type": "Nope"}, "unknown message type 'Nope'"),
    ({"request_id": "r"}, "unknown message type None"),
    ({"type": "Abort"}, "Abort.request_id: missing"),
    ({"type": "Abort", "request_id": 3}, "Abort.request_id: expected str, got int"),
    ({"type": "Abort", "request_id": "r", "x": 1}, "Abort: unknown fields ['x']"),
    ({"type": "Tokens", "request_id": "r", "token_ids": [1, "a"], "finish_reason": None},
     "Tokens.token_ids: expected list[int]"),
    ({"type": "Tokens", "request_id": "r", "token_ids": [True], "finish_reason": None},
     "Tokens.token_ids: expected list[int]"),
    ({"type": "LoadReport", "num_waiting": 1.5, "num_running": 0, "num_free_blocks": 0},
     "LoadReport.num_waiting: expected int, got float"),
])
def test_malformed_bodies_are_refused_by_name(body: object, error: str) -> None:
    with pytest.raises(MessageError, match=error.replace("[", r"\[").replace("]", r"\]")):
        from_wire(body)


def test_sampling_map() -> None:
    assert sampling_from_wire({"max_tokens": 3, "seed": 5}) == Sampling(3, seed=5)
    with pytest.raises(MessageError, match="sampling: unknown fields"):
        sampling_from_wire({"max_tokens": 3, "beam": 2})
    with pytest.raises(MessageError, match="sampling.max_tokens: missing"):
        sampling_from_wire({})
    with pytest.raises(MessageError, match="sampling.temperature"):
        sampling_from_wire({"max_tokens": 3, "temperature": "hot"})


def test_link_carries_messages_both_ways_and_reports_the_end() -> None:
    a, b = socket.socketpair()
    left, right = MessageLink(a), MessageLink(b)
    try:
        left.send(Tokens("r1", [1, 2], None))
        right.send(Abort("r1"))
        assert right.recv() == Tokens("r1", [1, 2], None)
        assert left.recv() == Abort("r1")
        left.close()
        assert right.recv() is None
        assert left.closed and not right.closed
    finally:
        left.close()
        right.close()


def test_link_refuses_a_garbage_frame() -> None:
    a, b = socket.socketpair()
    link = MessageLink(b)
    try:
        body = b"\xc1\xc1"  # bytes msgpack never produces
        a.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(MessageError, match="not valid msgpack"):
            link.recv()
    finally:
        a.close()
        link.close()

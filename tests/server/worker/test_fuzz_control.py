"""Hostile bytes at a worker's control port: random and truncated frames, huge lengths, bodies
that are not messages (non-maps, unknown types, missing or mistyped fields: the wire's "wrong
version"), and valid messages out of order (a `DecodeOrder`, `Abort` or `DecodeAdmitted` for a
request the worker never saw, messages only a worker sends). Each is refused (`RequestFailed`),
ignored, or closes that link; the worker keeps serving the next frontend link (a Ping gets its
Pong from the engine loop); no KV block, block-manager count or byte of the KV pool changes.

Orders that are meant to change the KV (a `PrefillOrder`, a `ReserveKv`) are not hostile input
and are not generated: with a cluster secret (test_worker_auth.py) a stranger cannot send them.
The control port serves one frontend link at a time (a new one replaces the old), so "everyone
else" here is the frontend's next link.
"""

from __future__ import annotations

import hashlib
import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcake.engine.config import EngineConfig
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import Hello, Ping, Pong
from kvcake.server.worker.worker import Worker
from kvcake.store.protocol import MAX_FRAME_BYTES
from tests.server.worker.links import next_of

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
ENGINE = EngineConfig(kv_cache_bytes=2 * 2**20)


@pytest.fixture(scope="module", params=[Role.DECODE, Role.COLOCATED])
def worker(request: pytest.FixtureRequest) -> Iterator[Worker]:
    with Worker(WorkerConfig(role=request.param, engine=ENGINE,
                             worker_id=f"fz-{request.param}")) as w:
        yield w


def kv_state(worker: Worker) -> tuple[Any, ...]:
    engine = worker.engine
    assert engine is not None
    blocks = engine.block_manager
    pool = hashlib.sha256(engine.pool.kv.detach().numpy().tobytes()).hexdigest()
    return blocks.num_free_blocks, tuple(blocks.free_block_ids()), pool


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def hostile_exchange(worker: Worker, data: bytes) -> None:
    """Connect as the frontend would, send `data`, then read until the worker closes the link
    or goes quiet; whatever it answers must be a valid message."""
    link = MessageLink.connect(worker.address)
    try:
        next_of(link, Hello)
        link._sock.sendall(data)
        link._sock.shutdown(socket.SHUT_WR)
        link._sock.settimeout(0.3)
        while True:
            try:
                if link.recv() is None:
                    return
            except OSError:  # quiet (timeout), or closed with a reset: both end the exchange
                return
    finally:
        link.close()


def still_serves(worker: Worker) -> None:
    link = MessageLink.connect(worker.address)
    try:
        assert next_of(link, Hello).worker_id == worker.worker_id
        link.send(Ping(7))
        assert next_of(link, Pong).seq == 7
    finally:
        link.close()


def wire(name: str, **fields: Any) -> bytes:
    return frame(msgpack.packb({"type": name, **fields}))


OUT_OF_ORDER = [
    wire("DecodeOrder", request_id="never-seen", prompt_token_ids=[1, 2, 3], first_token_id=4,
         sampling={"max_tokens": 2}),
    wire("Abort", request_id="never-seen", keep_reserved=False),
    wire("Abort", request_id="never-seen", keep_reserved=True),
    wire("DecodeAdmitted", request_id="never-seen"),
    wire("Tokens", request_id="never-seen", token_ids=[1], finish_reason=None),
    wire("KvReserved", request_id="never-seen", kv_pool={}, num_pool_blocks=1),
    wire("Pong", seq=3),
    wire("Hello", worker_id="x", role="decode", model_name="m", namespace="n", block_size=16,
         num_blocks=1, block_nbytes=1, layer_nbytes=1, num_layers=1, kv_bytes_per_token=1,
         max_model_len=1, vocab_size=1),
]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
not_messages = st.one_of(
    msgpack_values,
    st.fixed_dictionaries({"type": st.sampled_from(
        ["DecodeOrder", "Abort", "Ping", "ReserveKv", "PrefillOrder", "Nope", ""])},
        optional={"request_id": msgpack_values, "seq": msgpack_values,
                  "prompt_token_ids": msgpack_values, "sampling": msgpack_values}),
).map(lambda v: frame(msgpack.packb(v)))
hostile = st.one_of(
    st.binary(max_size=64),  # random bytes
    st.binary(min_size=1, max_size=40).map(lambda b: frame(b)[: max(1, len(b) // 2)]),  # cut
    st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n) + b"x"),
    not_messages,
    st.lists(st.sampled_from(OUT_OF_ORDER), min_size=1, max_size=4).map(b"".join),
)


@FUZZ
@given(data=hostile)
def test_hostile_frames_touch_no_kv_and_the_worker_keeps_serving(worker: Worker,
                                                                  data: bytes) -> None:
    before = kv_state(worker)
    hostile_exchange(worker, data)
    still_serves(worker)
    assert kv_state(worker) == before


def test_every_out_of_order_message_leaves_the_kv_untouched(worker: Worker) -> None:
    before = kv_state(worker)
    for data in OUT_OF_ORDER:
        hostile_exchange(worker, data)
    still_serves(worker)
    assert kv_state(worker) == before

"""One worker driven directly over its control link: Hello, orders, refusals, bad frames."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest

from kvcake import LLM, SamplingParams
from kvcake.engine.config import EngineConfig
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.messages import (
    DecodeOrder,
    Hello,
    LoadReport,
    MessageLink,
    PrefillDone,
    PrefillOrder,
    RequestFailed,
    Shutdown,
    Tokens,
)
from kvcake.server.worker.worker import Worker
from tests.server.worker.links import next_of

ENGINE = EngineConfig(kv_cache_bytes=4 * 2**20)


@pytest.fixture(scope="module")
def colocated() -> Iterator[Worker]:
    with Worker(WorkerConfig(role=Role.COLOCATED, engine=ENGINE, worker_id="c0")) as worker:
        yield worker


def test_hello_describes_the_kv_layout(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address)
    try:
        hello = next_of(link, Hello)
        assert isinstance(hello, Hello)
        assert (hello.worker_id, hello.role, hello.block_size, hello.num_layers) == (
            "c0", "colocated", 16, 4)
        assert hello.namespace == "kvcake/tiny/seed0/float32/b16"
        assert hello.block_nbytes == hello.layer_nbytes * 4 == 16 * hello.kv_bytes_per_token
        assert hello.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4  # K,V x layers x heads x dim x fp32
        assert (hello.staging, hello.num_staging_blocks) == (None, 0)
    finally:
        link.close()


def test_colocated_order_streams_the_offline_tokens(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address)
    prompt = list(range(40))
    try:
        next_of(link, Hello)
        link.send(PrefillOrder("c-1", prompt, {"max_tokens": 5, "ignore_eos": True}, [], {}, []))
        done = next_of(link, PrefillDone)
        assert isinstance(done, PrefillDone) and done.finish_reason is None
        out = [done.first_token_id]
        while True:
            message = next_of(link, Tokens)
            assert isinstance(message, Tokens)
            out += message.token_ids
            if message.finish_reason is not None:
                assert message.finish_reason == "length"
                break
    finally:
        link.close()
    [ref] = LLM("tiny", config=ENGINE).generate([prompt], SamplingParams(5, ignore_eos=True))
    assert out == ref.token_ids


def test_a_refused_order_is_reported_and_the_worker_keeps_serving(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address)
    try:
        next_of(link, Hello)
        link.send(PrefillOrder("bad", [1, 9999], {"max_tokens": 2}, [], {}, []))
        failed = next_of(link, RequestFailed)
        assert isinstance(failed, RequestFailed) and failed.request_id == "bad"
        assert "token id 9999 at index 1 is outside the vocabulary" in failed.message
        link.send(PrefillOrder("bad2", [1], {"max_tokens": 2, "beam": 3}, [], {}, []))
        failed = next_of(link, RequestFailed)
        assert isinstance(failed, RequestFailed) and "sampling: unknown fields" in failed.message
        link.send(PrefillOrder("ok", [1, 2, 3], {"max_tokens": 1}, [], {}, []))
        done = next_of(link, PrefillDone)
        assert isinstance(done, PrefillDone) and done.finish_reason == "length"
    finally:
        link.close()


def test_a_garbage_frame_drops_the_link_not_the_worker(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address)
    next_of(link, Hello)
    link._sock.sendall(struct.pack(">I", 2) + b"\xc1\xc1")
    while (message := link.recv()) is not None:  # the worker closes this link ...
        assert isinstance(message, LoadReport)
    link.close()
    again = MessageLink.connect(colocated.address)  # ... and keeps serving
    try:
        assert isinstance(next_of(again, Hello), Hello)
    finally:
        again.close()


def test_shutdown_is_passed_to_the_process_owner(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address)
    try:
        next_of(link, Hello)
        assert not colocated.shutdown_requested.is_set()
        link.send(Shutdown())
        assert colocated.shutdown_requested.wait(timeout=20)
    finally:
        link.close()


def test_decode_order_with_bad_staging_slots_is_refused() -> None:
    config = WorkerConfig(role=Role.DECODE, engine=ENGINE, worker_id="d0",
                          staging_bytes=8 * 16 * 2048)
    with Worker(config) as worker:
        link = MessageLink.connect(worker.address)
        try:
            hello = next_of(link, Hello)
            assert isinstance(hello, Hello) and hello.num_staging_blocks == 8
            assert hello.staging is not None and hello.staging["name"] == "kv-staging-d0"
            link.send(DecodeOrder("x", list(range(20)), 7, {"max_tokens": 4}, [0, 99]))
            failed = next_of(link, RequestFailed)
            assert isinstance(failed, RequestFailed)
            assert "decode refused: kv_blocks: each block must be" in failed.message
            link.send(DecodeOrder("y", list(range(20)), 7, {"max_tokens": 1}, [0, 1]))
            failed = next_of(link, RequestFailed)
            assert isinstance(failed, RequestFailed) and "max_tokens: must be >= 2" in \
                failed.message
        finally:
            link.close()


def test_worker_config_is_validated() -> None:
    with pytest.raises(ValueError, match="role: must be one of prefill, decode, colocated"):
        WorkerConfig(role="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staging_bytes: must be >= 1"):
        WorkerConfig(staging_bytes=0)
    with pytest.raises(ValueError, match="staging_bytes: .* holds no KV block"):
        Worker(WorkerConfig(role=Role.DECODE, engine=ENGINE, staging_bytes=100)).start()


def test_an_unreachable_master_fails_start_cleanly() -> None:
    import socket

    from kvcake.store import MasterUnavailable

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    worker = Worker(WorkerConfig(role=Role.PREFILL, engine=ENGINE, master=dead))
    with pytest.raises(MasterUnavailable, match="cannot connect"):
        worker.start()
    assert worker.transfer is not None and not worker._threads

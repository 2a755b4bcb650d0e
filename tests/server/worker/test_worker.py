"""One worker driven directly over its control link: Hello, orders, refusals, bad frames."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest

from kvcake import LLM, SamplingParams
from kvcake.auth import ClusterSecret
from kvcake.engine.config import EngineConfig
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Hello,
    LoadReport,
    PrefillDone,
    PrefillOrder,
    RequestFailed,
    Shutdown,
    Tokens,
)
from kvcake.server.worker.worker import Worker
from tests.server.worker.links import next_of

ENGINE = EngineConfig(kv_cache_bytes=4 * 2**20)
# The worker admits only links that prove this module's secret: a worker keeps one frontend
# link and a newer one replaces it, so a stray connection (another test's frontend still
# reconnecting to an address this worker's port now reuses) would otherwise take the link
# mid-request. Seen once in CI, 2026-12-02.
SECRET = ClusterSecret.generate()


@pytest.fixture(scope="module")
def colocated() -> Iterator[Worker]:
    with Worker(WorkerConfig(role=Role.COLOCATED, engine=ENGINE, worker_id="c0",
                             secret=SECRET)) as worker:
        yield worker


def test_hello_describes_the_kv_layout(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address, secret=SECRET)
    try:
        hello = next_of(link, Hello)
        assert (hello.worker_id, hello.role, hello.block_size, hello.num_layers) == (
            "c0", "colocated", 16, 4)
        assert hello.namespace == "kvcake/tiny/seed0/float32/b16"
        assert hello.block_nbytes == hello.layer_nbytes * 4 == 16 * hello.kv_bytes_per_token
        assert hello.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4  # K,V x layers x heads x dim x fp32
        assert colocated.engine is not None
        assert (hello.num_blocks, hello.vocab_size) == (colocated.engine.num_blocks,
                                                        colocated.engine.model_config.vocab_size)
    finally:
        link.close()


def test_colocated_order_streams_the_offline_tokens(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address, secret=SECRET)
    prompt = list(range(40))
    try:
        next_of(link, Hello)
        link.send(PrefillOrder("c-1", prompt, {"max_tokens": 5, "ignore_eos": True}, [], {}, []))
        done = next_of(link, PrefillDone)
        assert (done.request_id, done.finish_reason, done.transfer_bytes) == ("c-1", None, 0)
        out = [done.first_token_id]
        while True:
            message = next_of(link, Tokens)
            assert message.request_id == "c-1"
            out += message.token_ids
            if message.finish_reason is not None:
                assert message.finish_reason == "length"
                break
    finally:
        link.close()
    [ref] = LLM("tiny", config=ENGINE).generate([prompt], SamplingParams(5, ignore_eos=True))
    assert out == ref.token_ids


def test_a_refused_order_is_reported_and_the_worker_keeps_serving(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address, secret=SECRET)
    try:
        next_of(link, Hello)
        link.send(PrefillOrder("bad", [1, 9999], {"max_tokens": 2}, [], {}, []))
        failed = next_of(link, RequestFailed)
        assert failed.request_id == "bad"
        assert "token id 9999 at index 1 is outside the vocabulary" in failed.message
        link.send(PrefillOrder("bad2", [1], {"max_tokens": 2, "beam": 3}, [], {}, []))
        failed = next_of(link, RequestFailed)
        assert failed.request_id == "bad2" and "sampling: unknown fields" in failed.message
        link.send(PrefillOrder("ok", [1, 2, 3], {"max_tokens": 1}, [], {}, []))
        done = next_of(link, PrefillDone)
        assert (done.request_id, done.finish_reason) == ("ok", "length")
    finally:
        link.close()


def test_a_garbage_frame_drops_the_link_not_the_worker(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address, secret=SECRET)
    next_of(link, Hello)
    link._sock.sendall(struct.pack(">I", 2) + b"\xc1\xc1")
    while (message := link.recv()) is not None:  # the worker closes this link ...
        assert isinstance(message, LoadReport)
    link.close()
    again = MessageLink.connect(colocated.address, secret=SECRET)  # ... and keeps serving
    try:
        assert next_of(again, Hello).worker_id == "c0"
    finally:
        again.close()


def test_shutdown_is_passed_to_the_process_owner(colocated: Worker) -> None:
    link = MessageLink.connect(colocated.address, secret=SECRET)
    try:
        next_of(link, Hello)
        assert not colocated.shutdown_requested.is_set()
        link.send(Shutdown())
        assert colocated.shutdown_requested.wait(timeout=20)
    finally:
        link.close()


def test_an_order_with_targets_outside_the_decode_pool_is_refused(colocated: Worker) -> None:
    """Targets are blocks of the decode pool the order names: without a pool size, or past
    its end, the order would write the wrong place, so it is refused before any compute."""
    link = MessageLink.connect(colocated.address, secret=SECRET)
    pool = {"name": "kv-pool-d9", "segment_id": 1, "length_bytes": 1 << 20}
    try:
        next_of(link, Hello)
        link.send(PrefillOrder("t0", list(range(20)), {"max_tokens": 2}, [], pool, [0, 1]))
        failed = next_of(link, RequestFailed)
        assert failed.request_id == "t0"
        assert "num_pool_blocks: must be >= 1 with target blocks, got 0" in failed.message
        link.send(PrefillOrder("t1", list(range(20)), {"max_tokens": 2}, [], pool, [-1, 4], 4))
        failed = next_of(link, RequestFailed)
        assert failed.request_id == "t1"
        assert "target_blocks: each must be -1 or a block of the decode pool (< 4)" in \
            failed.message
        link.send(PrefillOrder("ok", [1, 2, 3], {"max_tokens": 1}, [], {}, []))
        assert next_of(link, PrefillDone).request_id == "ok"
    finally:
        link.close()


def test_worker_config_is_validated() -> None:
    with pytest.raises(ValueError, match="role: must be one of prefill, decode, colocated"):
        WorkerConfig(role="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="store_dram_bytes: must be >= 1, got 0"):
        WorkerConfig(store_dram_bytes=0)
    with pytest.raises(ValueError, match=r"port: must be in \[0, 65535\], got 70000"):
        WorkerConfig(port=70000)
    with pytest.raises(ValueError, match="num_threads: must be >= 1, got 0"):
        WorkerConfig(num_threads=0)


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

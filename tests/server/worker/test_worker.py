"""One worker driven directly over its control link: Hello, orders, refusals, bad frames."""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from types import TracebackType

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
    PrefillStarted,
    RequestFailed,
    Shutdown,
    Tokens,
)
from kvcake.server.worker.worker import Worker
from tests.net import refused_address
from tests.server.worker.links import next_of

ENGINE = EngineConfig(kv_cache_bytes=4 * 2**20)
# The worker admits only links that prove this module's secret: a worker keeps one frontend
# link and a newer one replaces it, so a connection from another process on a shared machine
# (to a port it believes dead) must not take it. The CI failure of 2026-12-02 (two tests here
# saw their link closed mid-request) was the worker's own admission order instead: see
# test_a_late_admission_never_replaces_a_newer_link.
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


def test_each_prefill_reports_its_start_when_the_engine_schedules_its_first_chunk() -> None:
    """Orders wait in the worker's engine one behind another (a 16-token budget, 48-token
    prompts): the second is reported started only after the first is done, so the Conductor's
    queue does not run both down at once."""
    engine = EngineConfig(kv_cache_bytes=4 * 2**20, max_num_batched_tokens=16)
    with Worker(WorkerConfig(role=Role.COLOCATED, engine=engine, worker_id="c1",
                             secret=SECRET)) as worker:
        link = MessageLink.connect(worker.address, secret=SECRET)
        try:
            next_of(link, Hello)
            for rid in ("a", "b"):
                link.send(PrefillOrder(rid, list(range(1, 49)), {"max_tokens": 1}, [], {}, []))
            seen = []
            while len(seen) < 4:
                message = next_of(link, PrefillStarted, PrefillDone, Tokens)
                if not isinstance(message, Tokens):
                    seen.append((type(message).__name__, message.request_id))
        finally:
            link.close()
    assert seen == [("PrefillStarted", "a"), ("PrefillDone", "a"),
                    ("PrefillStarted", "b"), ("PrefillDone", "b")]


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


class _FirstWaitsForSecond:
    """The worker's link lock, except that the first thread to take it waits until a second
    one has taken and released it: an admit thread that lost the CPU between sending Hello
    and installing its link (what a loaded machine does), made to happen every time."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._order: dict[int, int] = {}  # thread id -> 1 (first in) or 2 (second)
        self._second_out = threading.Event()
        self.first_out = threading.Event()

    def __enter__(self) -> None:
        me = threading.get_ident()
        self._order[me] = len(self._order) + 1
        if self._order[me] == 1:
            assert self._second_out.wait(10), "no second admission came"
        self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()
        done = {1: self.first_out, 2: self._second_out}.get(self._order[threading.get_ident()])
        if done is not None:
            done.set()


def test_a_late_admission_never_replaces_a_newer_link(colocated: Worker,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that reads Hello, closes and connects again (one test after another, or a
    frontend that restarts) must keep its new link even when the worker finishes admitting
    the old connection after the new one: the older connection is closed, not installed."""
    gate = _FirstWaitsForSecond(colocated._link_lock)
    monkeypatch.setattr(colocated, "_link_lock", gate)
    first = MessageLink.connect(colocated.address, secret=SECRET)
    next_of(first, Hello)  # sent before the link is installed: that thread now waits
    first.close()
    second = MessageLink.connect(colocated.address, secret=SECRET)
    try:
        next_of(second, Hello)
        assert gate.first_out.wait(10)  # the first admission ended after the second one
        second.send(PrefillOrder("late", [1, 2, 3], {"max_tokens": 1}, [], {}, []))
        assert next_of(second, PrefillDone).request_id == "late"
    finally:
        second.close()


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
    from kvcake.store import MasterUnavailable

    before = set(threading.enumerate())
    with refused_address() as dead:
        worker = Worker(WorkerConfig(role=Role.PREFILL, engine=ENGINE, master=dead))
        with pytest.raises(MasterUnavailable, match="cannot connect"):
            worker.start()
    assert worker.transfer is not None and not worker._threads
    # nothing it started runs on (its store node's control server was left serving once)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []

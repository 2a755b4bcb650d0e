"""The frontend's worker links (worker_set.py): handshake order, readers that deliver in
order and report a lost link once, load and pong reports, hung-worker probing, loss."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Iterator

import pytest

from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.cluster.worker_set import WorkerSet
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    KvEvents,
    LoadReport,
    Message,
    Ping,
    Pong,
    ReserveKv,
)
from tests.server.cluster.fakes import NUM_BLOCKS, FakeWorker, hello

MONITOR = MonitorConfig(worker_timeout_s=5.0, ping_interval_s=1.0)


@pytest.fixture
def pair() -> Iterator[tuple[FakeWorker, FakeWorker, WorkerSet]]:
    p, d = FakeWorker("prefill-0", "prefill").start(), FakeWorker("decode-1", "decode").start()
    workers = WorkerSet()
    yield p, d, workers
    workers.close()
    p.close()
    d.close()


def test_connect_returns_the_hellos_in_address_order(
        pair: tuple[FakeWorker, FakeWorker, WorkerSet]) -> None:
    p, d, workers = pair
    assert workers.connect([d.address, p.address]) == [d.hello, p.hello]
    assert workers.live_ids() == ["decode-1", "prefill-0"]
    assert workers.get("nope") is None and not workers.send("nope", Ping(1))


def test_readers_deliver_in_order_and_report_a_closed_link_once(
        pair: tuple[FakeWorker, FakeWorker, WorkerSet]) -> None:
    p, d, workers = pair
    workers.connect([p.address, d.address])
    got: queue.Queue[tuple[str, Message | None]] = queue.Queue()
    workers.start_readers(lambda w, m: got.put((w, m)), lambda w: got.put((w, None)))
    p.send(KvEvents([1], []))
    p.send(Pong(3))
    assert [got.get(timeout=10), got.get(timeout=10)] == [("prefill-0", KvEvents([1], [])),
                                                          ("prefill-0", Pong(3))]
    p.close()
    assert got.get(timeout=10) == ("prefill-0", None)
    assert workers.mark_lost("prefill-0") and not workers.mark_lost("prefill-0")
    assert workers.live_ids() == ["decode-1"] and not workers.send("prefill-0", Ping(1))
    assert got.empty()


def test_load_reports_give_the_fullest_live_workers_usage(
        pair: tuple[FakeWorker, FakeWorker, WorkerSet]) -> None:
    p, d, workers = pair
    workers.connect([p.address, d.address])
    assert workers.kv_cache_usage() == 0.0  # no report yet
    assert workers.on_report("prefill-0", LoadReport(0, 1, NUM_BLOCKS // 4))
    assert workers.on_report("decode-1", LoadReport(2, 3, NUM_BLOCKS // 2))
    assert workers.kv_cache_usage() == 0.75
    workers.mark_lost("prefill-0")
    assert workers.kv_cache_usage() == 0.5
    assert not workers.on_report("decode-1", KvEvents([], []))  # not a report about itself


def test_an_unanswered_ping_marks_the_worker_hung_after_the_timeout(
        pair: tuple[FakeWorker, FakeWorker, WorkerSet]) -> None:
    p, d, workers = pair
    workers.connect([p.address, d.address])
    assert workers.hung(0.0, MONITOR) == []
    assert (p.next(), d.next()) == (Ping(1), Ping(1))
    workers.on_report("decode-1", Pong(1))
    assert workers.hung(5.0, MONITOR) == []  # p's ping is 5 s old: not over the timeout yet
    assert d.next() == Ping(2)  # d answered: the next ping is due after ping_interval_s
    assert workers.hung(5.5, MONITOR) == ["prefill-0"]
    workers.mark_lost("prefill-0")
    assert workers.hung(100.0, MONITOR) == ["decode-1"]  # a lost worker is not probed again


class DeafWorker:
    """Says `Hello`, then never reads: whatever the frontend sends it piles up in the socket
    buffers until a send can no longer go out (a stopped or wedged worker process)."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> DeafWorker:
        self._thread.start()
        return self

    def _serve(self) -> None:
        conn, _ = self._server.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self._conns.append(conn)
        MessageLink(conn).send(hello("decode-9", "decode"))

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._server.close()
        self._thread.join(timeout=10)


def test_a_worker_that_stops_reading_fails_a_send_and_is_reported_lost() -> None:
    deaf = DeafWorker().start()
    workers = WorkerSet()
    try:
        workers.connect([deaf.address], send_timeout_s=0.5)
        lost: queue.Queue[str] = queue.Queue()
        workers.start_readers(lambda worker_id, message: None, lost.put)
        order = ReserveKv("r", list(range(200_000)), {"max_tokens": 2})  # ~600 KB a frame
        sends = [workers.send("decode-9", order)]
        while sends[-1] and len(sends) < 64:  # 64 frames: far beyond the socket buffers
            sends.append(workers.send("decode-9", order))
        assert sends[0] and not sends[-1]  # the sender was never stuck: a send failed instead
        assert lost.get(timeout=10) == "decode-9"  # its link was closed: the reader says so
        assert workers.mark_lost("decode-9") and not workers.is_live("decode-9")
    finally:
        workers.close()
        deaf.close()

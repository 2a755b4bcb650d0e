"""The disaggregated backend's wiring (cluster/backend.py) with fake workers: `DisaggConfig`
errors, a backend that is not started, messages routed from the reader threads, lost and hung
workers. The full path with real engines is in test_disagg.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvcake.clock import ManualClock
from kvcake.hashing import block_keys
from kvcake.server.cluster.backend import DisaggBackend, DisaggConfig
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.frontend.backend import (
    BackendStats,
    FinishReason,
    GenerateRequest,
    Rejected,
    TokenEvent,
)
from kvcake.server.worker.messages import (
    DecodeAdmitted,
    DecodeOrder,
    KvEvents,
    KvReserved,
    LoadReport,
    Ping,
    PrefillDone,
    PrefillOrder,
    ReserveKv,
    Tokens,
)
from kvcake.store.errors import MasterUnavailable
from kvcake.types import RequestId
from tests.net import refused_address
from tests.server.cluster.fakes import BLOCK_SIZE, DECODE, NUM_BLOCKS, PREFILL, FakeWorker

PROMPT = tuple(range(1, 41))
POOL = {"name": "kv-pool-decode-1"}


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^worker_addresses: pass at least one worker address"):
        DisaggConfig("tiny", ())
    with pytest.raises(ValueError, match=r"^worker_addresses: pass a list of HOST:PORT strings"):
        DisaggConfig("tiny", "127.0.0.1:1")  # type: ignore[arg-type]
    config = DisaggConfig("tiny", ["127.0.0.1:1"])  # type: ignore[arg-type]
    assert config.worker_addresses == ("127.0.0.1:1",) and config.run_monitor


def test_a_backend_that_is_not_started_serves_nothing_and_closes() -> None:
    backend = DisaggBackend(DisaggConfig("tiny", ("127.0.0.1:1",)), PREFILL, DECODE)
    assert backend.stats() == BackendStats(extra={"kv_stream_hidden_share": 0.0,
                                                  "fetched_tokens": 0.0, "live_workers": 0.0})
    assert (backend.live_worker_ids(), backend.check_workers(), backend.audit_store()) == \
        ([], [], [])
    assert backend.conductor is None and backend.store_audit is None and backend._flights == {}
    backend.abort("r")  # nothing to abort
    with pytest.raises(ValueError, match=r"^worker: no live worker 'prefill-0'"):
        backend.set_draining("prefill-0", True)
    with pytest.raises(RuntimeError, match="DisaggBackend not started"):
        _ = backend.max_model_len
    backend.close()


@pytest.fixture
def running() -> Iterator[tuple[DisaggBackend, FakeWorker, FakeWorker, ManualClock]]:
    p, d = FakeWorker("prefill-0", "prefill").start(), FakeWorker("decode-1", "decode").start()
    clock = ManualClock()
    config = DisaggConfig("tiny", (p.address, d.address), run_monitor=False,
                          monitor=MonitorConfig(worker_timeout_s=5.0, ping_interval_s=1.0))
    backend = DisaggBackend(config, PREFILL, DECODE, clock).start()
    yield backend, p, d, clock
    backend.close()
    p.close()
    d.close()


def test_worker_messages_reach_the_conductor_the_flight_and_the_stats(
        running: tuple[DisaggBackend, FakeWorker, FakeWorker, ManualClock]) -> None:
    backend, p, d, _ = running
    keys = [int(k) for k in block_keys(PROMPT, BLOCK_SIZE, p.hello.namespace)]

    async def serve() -> list[TokenEvent]:
        stream = await backend.generate(GenerateRequest(RequestId("r"), PROMPT, 3))
        assert isinstance(d.next(), ReserveKv)
        d.send(LoadReport(0, 1, NUM_BLOCKS // 4))
        d.send(KvReserved("r", POOL, NUM_BLOCKS, [1, 2, 3]))
        assert isinstance(p.next(), PrefillOrder)
        p.send(KvEvents(keys, []))  # read before the PrefillDone behind it on the same link
        p.send(PrefillDone("r", 42, None, 0, 0, 0.5, 0.4, 0.1, 3 * 4096))
        first = await stream.__anext__()
        assert isinstance(d.next(), DecodeOrder)
        stats = backend.stats()
        assert (stats.num_waiting_requests, stats.num_running_requests) == (0, 1)
        assert stats.kv_cache_usage == 0.75 and stats.transfer_bytes == 3 * 4096
        d.send(DecodeAdmitted("r"))
        d.send(Tokens("r", [5, 6], "length"))
        return [first] + [event async for event in stream]

    events = asyncio.run(serve())
    assert events == [TokenEvent((42,), 0, None), TokenEvent((5, 6), 0, FinishReason.LENGTH)]
    # The reader emits the last event, then ends the flight, both under the backend's lock;
    # stats() takes that lock, so once it answers the flight is gone.
    assert backend.stats().num_running_requests == 0
    assert backend.conductor is not None
    assert dict(backend.conductor.index.match(keys).blocks_by_holder) == {"prefill-0": 2}
    assert backend._flights == {} and backend.totals.num_prefills == 1


def test_a_closed_worker_link_fails_its_requests_and_leaves_the_pools(
        running: tuple[DisaggBackend, FakeWorker, FakeWorker, ManualClock]) -> None:
    backend, p, d, _ = running

    async def serve() -> None:
        stream = await backend.generate(GenerateRequest(RequestId("r"), PROMPT, 3))
        assert isinstance(d.next(), ReserveKv)
        d.close()
        with pytest.raises(RuntimeError, match=r"^decode worker decode-1 failed while serving "
                                               r"this request; retry it$"):
            await stream.__anext__()

    asyncio.run(serve())
    assert backend.live_worker_ids() == ["prefill-0"]
    assert backend.conductor is not None and backend.conductor.decode_ids == []


def test_workers_that_leave_pings_unanswered_are_failed_as_hung(
        running: tuple[DisaggBackend, FakeWorker, FakeWorker, ManualClock]) -> None:
    backend, p, d, clock = running

    async def serve() -> None:
        stream = await backend.generate(GenerateRequest(RequestId("r"), PROMPT, 3))
        assert isinstance(d.next(), ReserveKv)
        assert backend.check_workers() == []
        assert (p.next(), d.next()) == (Ping(1), Ping(1))
        clock.advance(5.5)
        assert backend.check_workers() == ["prefill-0", "decode-1"]
        with pytest.raises(RuntimeError, match=r"^prefill worker prefill-0 failed"):
            await stream.__anext__()
        with pytest.raises(Rejected, match=r"no_instance"):
            await backend.generate(GenerateRequest(RequestId("s"), PROMPT, 3))

    asyncio.run(serve())
    assert backend.live_worker_ids() == [] and backend.stats().extra["live_workers"] == 0.0


def test_a_start_that_fails_after_connecting_closes_every_link() -> None:
    p, d = FakeWorker("prefill-0", "prefill").start(), FakeWorker("decode-1", "decode").start()
    try:
        with refused_address() as dead:  # the store master is unreachable
            config = DisaggConfig("tiny", (p.address, d.address), store_master=dead,
                                  run_monitor=False)
            backend = DisaggBackend(config, PREFILL, DECODE)
            with pytest.raises(MasterUnavailable, match="cannot connect to 127.0.0.1"):
                backend.start()
        assert p.wait_disconnected() and d.wait_disconnected()
        assert backend.live_worker_ids() == []
    finally:
        p.close()
        d.close()

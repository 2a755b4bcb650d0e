"""The requests in flight (flights.py): the exact orders each worker gets, in order, for
every worker reply, aborts and losses. Real links to fake workers (no engine), a real Conductor,
a manual clock; the test plays the reader thread (it hands each reply to `on_message`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

import pytest

from kvcake.clock import ManualClock
from kvcake.conductor import ConductorConfig
from kvcake.server.cluster.flight import Flight, Stage, TransferTotals, sampling_of
from kvcake.server.cluster.flights import Flights
from kvcake.server.cluster.router import Router, schedule_request
from kvcake.server.cluster.worker_set import WorkerSet
from kvcake.server.frontend.backend import FinishReason, GenerateRequest, TokenEvent
from kvcake.server.worker.messages import (
    Abort,
    CppOrder,
    DecodeAdmitted,
    DecodeOrder,
    KvReserved,
    Ping,
    PrefillDone,
    PrefillOrder,
    PrefillStarted,
    RequestFailed,
    ReserveKv,
    Tokens,
)
from kvcake.types import RequestId
from tests.server.cluster.fakes import DECODE, PREFILL, FakeWorker

POOL = {"name": "kv-pool-decode-1"}
PROMPT = tuple(range(1, 41))  # 40 tokens: 3 blocks of 16, the last one partial


@dataclass
class Bench:
    p: FakeWorker
    d: FakeWorker
    workers: WorkerSet
    router: Router
    flights: Flights
    loop: asyncio.AbstractEventLoop
    clock: ManualClock

    def admit(self, max_tokens: int = 5, rid: str = "r") -> asyncio.Queue[TokenEvent | BaseException]:
        request = GenerateRequest(RequestId(rid), PROMPT, max_tokens)
        placement = self.router.place(schedule_request(request, self.p.hello), 0.0)
        sink: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.flights.admit(Flight(request, sink, self.loop, placement, sampling_of(request)))
        return sink

    def events(self, sink: asyncio.Queue[TokenEvent | BaseException]) -> list[object]:
        self.loop.run_until_complete(asyncio.sleep(0))  # runs the emitted put_nowait calls
        return [sink.get_nowait() for _ in range(sink.qsize())]

    def reserve(self, block_ids: list[int], rid: str = "r") -> PrefillOrder:
        reserve = self.d.next()
        assert isinstance(reserve, ReserveKv) and reserve.request_id == rid
        self.flights.on_message("decode-1", KvReserved(rid, POOL, 64, block_ids))
        order = self.p.next()
        assert isinstance(order, PrefillOrder)
        return order


def done(first_token_id: int = 42, finish_reason: str | None = None) -> PrefillDone:
    return PrefillDone("r", first_token_id, finish_reason, num_cached_tokens=16,
                       num_fetched_tokens=0, compute_s=0.5, transfer_span_s=0.4,
                       transfer_exposed_s=0.1, transfer_bytes=3 * 4096)


@pytest.fixture
def bench() -> Iterator[Bench]:
    p, d = FakeWorker("prefill-0", "prefill").start(), FakeWorker("decode-1", "decode").start()
    workers = WorkerSet()
    hellos = workers.connect([p.address, d.address])
    router = Router.for_workers(ConductorConfig(), hellos, PREFILL, DECODE)
    loop, clock = asyncio.new_event_loop(), ManualClock()
    yield Bench(p, d, workers, router, Flights(workers, router, clock, TransferTotals()),
                loop, clock)
    workers.close()
    p.close()
    d.close()
    loop.close()


def test_a_request_reserves_prefills_decodes_and_ends_with_its_last_token(bench: Bench) -> None:
    sink = bench.admit(max_tokens=5)
    sampling = asdict(sampling_of(GenerateRequest(RequestId("r"), PROMPT, 5)))
    assert bench.d.next() == ReserveKv("r", list(PROMPT), sampling)
    assert bench.flights.by_id["r"].stage is Stage.RESERVING and bench.flights.counts() == (1, 0)
    bench.flights.on_message("decode-1", KvReserved("r", POOL, 64, [7, 8]))  # block 0 cached
    assert bench.p.next() == PrefillOrder("r", list(PROMPT), sampling, [], POOL, [-1, 7, 8], 64)

    bench.flights.on_message("prefill-0", done())
    assert bench.d.next() == DecodeOrder("r", list(PROMPT), 42, sampling, None)
    assert bench.events(sink) == [TokenEvent((42,), 16, None)]
    assert bench.flights.counts() == (0, 1) and bench.flights.totals.transfer_bytes == 3 * 4096
    bench.flights.on_message("decode-1", DecodeAdmitted("r"))
    assert bench.flights.by_id["r"].reserved is False
    bench.flights.on_message("decode-1", Tokens("r", [5, 6], "length"))
    assert bench.events(sink) == [TokenEvent((5, 6), 16, FinishReason.LENGTH)]
    assert bench.flights.by_id == {}
    assert isinstance(bench.d.probe(bench.workers), Ping)  # no Abort after the end


def test_the_conductor_runs_a_prefill_down_from_its_start_not_from_its_order(
        bench: Bench) -> None:
    """A worker computes its orders one after another: an order waiting behind another is not
    running, so the Conductor counts its whole predicted time until the worker says it began."""
    clock = bench.clock
    bench.admit(rid="a")
    bench.reserve([7, 8], rid="a")
    bench.admit(rid="b")
    bench.reserve([9, 10], rid="b")
    conductor, queue = bench.router.conductor, bench.router.conductor.prefill_queue("prefill-0")
    predicted = queue.queue_s(0.0)  # both orders out, neither begun
    assert predicted > 0 and len(queue) == 2
    clock.advance(100.0)  # long past both predictions: still all of it, nothing began
    assert conductor.queue_s("prefill-0", clock.now_s()) == pytest.approx(predicted)
    bench.flights.on_message("prefill-0", PrefillStarted("a"))
    started = clock.now_s()
    clock.advance(1e-4)
    left = conductor.queue_s("prefill-0", clock.now_s())
    assert left == pytest.approx(predicted - 1e-4)
    clock.advance(100.0)  # a is overdue: only b's time is left
    assert 0 < conductor.queue_s("prefill-0", clock.now_s()) < predicted
    assert clock.now_s() > started
    bench.flights.on_message("prefill-0", PrefillStarted("zz"))  # no such flight: dropped


def test_a_one_token_request_reserves_two_and_cancels_after_its_prefill(bench: Bench) -> None:
    sink = bench.admit(max_tokens=1)
    reserve = bench.d.next()
    assert isinstance(reserve, ReserveKv) and reserve.sampling["max_tokens"] == 2
    bench.flights.on_message("decode-1", KvReserved("r", POOL, 64, [3, 4, 5]))
    order = bench.p.next()
    assert isinstance(order, PrefillOrder) and order.sampling["max_tokens"] == 1
    bench.flights.on_message("prefill-0", done(finish_reason="length"))
    assert bench.events(sink) == [TokenEvent((42,), 16, FinishReason.LENGTH)]
    assert bench.d.next() == Abort("r")  # the reservation, never committed, is handed back
    assert bench.flights.by_id == {}


def test_an_abort_mid_prefill_cancels_the_reservation_only_once_the_prefill_acks(
        bench: Bench) -> None:
    sink = bench.admit()
    bench.reserve([1, 2, 3])
    bench.flights.abort("r")
    assert bench.p.next() == Abort("r")
    assert isinstance(bench.d.probe(bench.workers), Ping)  # p may still write: no Abort to d
    assert bench.flights.by_id["r"].stage is Stage.DONE and bench.flights.counts() == (0, 0)
    bench.flights.on_message("prefill-0", RequestFailed("r", "aborted"))  # p's ack
    assert bench.d.next() == Abort("r")
    assert bench.flights.by_id == {} and bench.events(sink) == []


def test_an_abort_while_reserving_cancels_at_once(bench: Bench) -> None:
    sink = bench.admit()
    assert isinstance(bench.d.next(), ReserveKv)
    bench.flights.abort("r")
    assert (bench.p.next(), bench.d.next()) == (Abort("r"), Abort("r"))
    assert bench.flights.by_id == {} and bench.events(sink) == []
    bench.flights.abort("r")  # a second abort (aclose twice) is a no-op
    assert isinstance(bench.p.probe(bench.workers), Ping)


def test_a_lost_decode_worker_fails_its_request_with_a_retry_hint(bench: Bench) -> None:
    sink = bench.admit()
    bench.reserve([1, 2, 3])
    bench.flights.on_message("prefill-0", done())
    assert isinstance(bench.d.next(), DecodeOrder)
    assert bench.events(sink) == [TokenEvent((42,), 16, None)]
    assert bench.workers.mark_lost("decode-1")
    bench.flights.on_worker_lost("decode-1")
    [error] = bench.events(sink)
    assert isinstance(error, RuntimeError)
    assert str(error) == "decode worker decode-1 failed while serving this request; retry it"
    assert bench.p.next() == Abort("r") and bench.flights.by_id == {}


def test_a_request_placed_on_a_gone_decode_worker_fails_at_once(bench: Bench) -> None:
    assert bench.workers.mark_lost("decode-1")
    sink = bench.admit()
    [error] = bench.events(sink)
    assert isinstance(error, RuntimeError) and str(error) == "decode worker decode-1 is gone"
    assert bench.p.next() == Abort("r") and bench.flights.by_id == {}


def test_more_reserved_blocks_than_the_prompt_has_fail_the_request(bench: Bench) -> None:
    sink = bench.admit()
    assert isinstance(bench.d.next(), ReserveKv)
    bench.flights.on_message("decode-1", KvReserved("r", POOL, 64, [1, 2, 3, 4]))
    [error] = bench.events(sink)
    assert str(error) == "decode worker reserved more blocks than the prompt has"
    assert (bench.p.next(), bench.d.next()) == (Abort("r"), Abort("r"))
    assert bench.flights.by_id == {}


def test_a_worker_error_ends_the_stream_with_its_message(bench: Bench) -> None:
    sink = bench.admit()
    bench.reserve([1, 2, 3])
    bench.flights.on_message("prefill-0", RequestFailed("r", "prompt too long"))
    [error] = bench.events(sink)
    assert str(error) == "worker prefill-0: prompt too long"
    assert (bench.p.next(), bench.d.next()) == (Abort("r"), Abort("r"))


def test_shutdown_fails_every_flight(bench: Bench) -> None:
    sinks = [bench.admit(rid="a"), bench.admit(rid="b")]
    bench.flights.fail_all("the server is shutting down")
    errors = [bench.events(sink) for sink in sinks]
    assert [[str(e) for e in batch] for batch in errors] == [["the server is shutting down"]] * 2
    assert bench.flights.by_id == {}


def test_a_prefill_worker_lost_mid_prefill_leaves_its_reservation_out_of_use(
        bench: Bench) -> None:
    sink = bench.admit()
    bench.reserve([1, 2, 3])
    assert bench.workers.mark_lost("prefill-0")
    bench.flights.on_worker_lost("prefill-0")  # it may be hung, still writing blocks 1-3
    [error] = bench.events(sink)
    assert str(error) == "prefill worker prefill-0 failed while serving this request; retry it"
    assert bench.d.next() == Abort("r", keep_reserved=True)  # never a plain (cancelling) Abort
    assert isinstance(bench.d.probe(bench.workers), Ping)
    assert bench.flights.by_id == {}
    # Once its process is reaped (it cannot write any more) the blocks go back to d.
    assert bench.flights.on_worker_dead("prefill-0") == 1
    assert bench.d.next() == Abort("r")
    assert bench.flights.on_worker_dead("prefill-0") == 0  # once only
    assert bench.flights.kept == {}


def test_an_abort_mid_prefill_then_a_lost_prefill_worker_keeps_the_reservation(
        bench: Bench) -> None:
    sink = bench.admit()
    bench.reserve([1, 2, 3])
    bench.flights.abort("r")
    assert bench.p.next() == Abort("r")
    assert bench.workers.mark_lost("prefill-0")
    bench.flights.on_worker_lost("prefill-0")  # the abort was never acked
    assert bench.d.next() == Abort("r", keep_reserved=True)
    assert isinstance(bench.d.probe(bench.workers), Ping)
    assert bench.flights.by_id == {} and bench.events(sink) == []


def test_a_prefill_worker_lost_after_its_prefill_cancels_nothing_it_could_write(
        bench: Bench) -> None:
    bench.admit()
    bench.reserve([1, 2, 3])
    bench.flights.on_message("prefill-0", done())  # p answered: it writes nothing more
    assert isinstance(bench.d.next(), DecodeOrder)
    assert bench.workers.mark_lost("prefill-0")
    bench.flights.on_worker_lost("prefill-0")
    assert bench.d.next() == Abort("r")  # the request is stopped; its blocks may be freed
    assert bench.flights.by_id == {}


@pytest.fixture
def group_bench() -> Iterator[tuple[Bench, FakeWorker, FakeWorker]]:
    """prefill-0, decode-1 and a CPP group (cpp-2 stage 0, cpp-3 stage 1); 40-token prompts
    go to the group."""
    p, d = FakeWorker("prefill-0", "prefill"), FakeWorker("decode-1", "decode")
    s0, s1 = FakeWorker("cpp-2", "cpp"), FakeWorker("cpp-3", "cpp")
    s0.hello = replace(s0.hello, cpp_member=0)
    s1.hello = replace(s1.hello, cpp_member=1, cpp_inbox={"name": "cpp-hidden-cpp-3"})
    for fake in (p, d, s0, s1):
        fake.start()
    workers = WorkerSet()
    hellos = workers.connect([f.address for f in (p, d, s0, s1)])
    config = ConductorConfig(cpp_min_tokens=32, cpp_nodes=2, cpp_chunk_tokens=16,
                             cpp_min_chunk_tokens=16)
    router = Router.for_workers(config, hellos, PREFILL, DECODE)
    loop, clock = asyncio.new_event_loop(), ManualClock()
    yield (Bench(p, d, workers, router, Flights(workers, router, clock, TransferTotals()),
                 loop, clock), s0, s1)
    workers.close()
    for fake in (p, d, s0, s1):
        fake.close()
    loop.close()


def test_a_cpp_request_moves_on_once_every_stage_is_done(
        group_bench: tuple[Bench, FakeWorker, FakeWorker]) -> None:
    bench, s0, s1 = group_bench
    sink = bench.admit(max_tokens=5)
    sampling = asdict(sampling_of(GenerateRequest(RequestId("r"), PROMPT, 5)))
    assert isinstance(bench.d.next(), ReserveKv)
    bench.flights.on_message("decode-1", KvReserved("r", POOL, 64, [7, 8]))  # block 0 cached
    assert s0.next() == CppOrder("r", list(PROMPT), sampling, {"name": "cpp-hidden-cpp-3"},
                                 POOL, [-1, 7, 8], 64)
    assert s1.next() == CppOrder("r", list(PROMPT), sampling, {}, POOL, [-1, 7, 8], 64)
    bench.flights.on_message("cpp-3", replace(done(42), num_cached_tokens=0))  # the token
    assert isinstance(bench.d.probe(bench.workers), Ping)  # stage 0 may still write
    assert bench.events(sink) == []
    bench.flights.on_message("cpp-2", replace(done(-1), num_cached_tokens=0))
    # the stages store the prompt (their layer slices), not the decode worker
    assert bench.d.next() == DecodeOrder("r", list(PROMPT), 42, sampling, None,
                                         store_prompt=False)
    assert bench.events(sink) == [TokenEvent((42,), 0, None)]
    assert bench.flights.totals.transfer_bytes == 2 * 3 * 4096  # both stages' layers


def test_a_failed_stage_stops_the_others_and_frees_the_blocks_once_they_ack(
        group_bench: tuple[Bench, FakeWorker, FakeWorker]) -> None:
    bench, s0, s1 = group_bench
    sink = bench.admit()
    assert isinstance(bench.d.next(), ReserveKv)
    bench.flights.on_message("decode-1", KvReserved("r", POOL, 64, [1, 2, 3]))
    assert isinstance(s0.next(), CppOrder) and isinstance(s1.next(), CppOrder)
    bench.flights.on_message("cpp-3", RequestFailed("r", "no KV room"))
    [error] = bench.events(sink)
    assert isinstance(error, RuntimeError) and "cpp-3: no KV room" in str(error)
    assert s0.next() == Abort("r")
    assert isinstance(bench.d.probe(bench.workers), Ping)  # stage 0 may still write
    bench.flights.on_message("cpp-2", RequestFailed("r", "aborted"))  # its ack
    assert bench.d.next() == Abort("r")
    assert bench.flights.by_id == {}

"""Workers joining a running frontend through etcd (cluster/membership.py, worker/membership.py),
with fake workers (a real control port saying Hello, no engine) and a real etcd."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from kvcake.conductor import ConductorConfig
from kvcake.registry import Etcd, Member, Registration
from kvcake.registry.members import list_members
from kvcake.server.cluster.backend import DisaggBackend, DisaggConfig
from kvcake.server.cluster.membership import EtcdWorkers
from kvcake.server.frontend.backend import GenerateRequest, Rejected
from kvcake.server.worker.membership import WorkerMembership, advertised
from kvcake.types import RequestId
from tests.net import refused_address
from tests.server.cluster.fakes import DECODE, PREFILL, FakeWorker, hello

WAIT_S = 10.0
# The fake workers' leases: they leave by revoking (at once), so a long TTL costs nothing, and
# a keepalive late by the default 3 s on a loaded machine no longer ends a lease mid-test
# (seen once: "lease ... lost: etcd says it expired", a member gone).
TTL_S = 30


def wait_until(condition: Callable[[], bool]) -> None:
    """Polls a condition another thread makes true (the watch); bounded, not a sleep."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def backend() -> Iterator[DisaggBackend]:
    config = DisaggConfig(model="tiny", worker_addresses=(), workers_join=True,
                          conductor=ConductorConfig.from_dict({"admission": "none"}),
                          run_monitor=False)
    backend = DisaggBackend(config, PREFILL, DECODE).start()
    yield backend
    backend.close()


def test_workers_join_leave_and_rejoin(etcd: Etcd, cluster: str,
                                       backend: DisaggBackend) -> None:
    request = GenerateRequest(RequestId("r0"), (1, 2, 3), 4, temperature=0.0)
    with pytest.raises(Rejected, match="no worker has joined"):
        asyncio.run(backend.generate(request))
    assert backend.max_model_len == 2048  # the model's own limit until a worker says its own
    watch = EtcdWorkers(backend, etcd, cluster, resync_s=1.0).start()
    fakes = [FakeWorker("p1", "prefill").start(), FakeWorker("d1", "decode").start()]
    regs = [Registration(etcd, cluster, Member(f.hello.role, f.hello.worker_id, f.address),
                         TTL_S).start() for f in fakes]
    restarted = None
    try:
        wait_until(lambda: sorted(backend.live_worker_ids()) == ["d1", "p1"])
        assert backend.conductor is not None
        assert backend.conductor.prefill_ids == ["p1"] and backend.conductor.decode_ids == ["d1"]
        assert backend.max_model_len == 512  # the workers' setting now
        assert backend.stats().extra["live_workers"] == 2.0  # what /health reports

        regs[1].close()  # the decode worker's lease ends (it left or died)
        wait_until(lambda: backend.live_worker_ids() == ["p1"])
        assert backend.conductor.decode_ids == []
        assert fakes[1].wait_disconnected()

        restarted = FakeWorker("d1", "decode").start()  # the same worker id, a new process
        regs[1] = Registration(etcd, cluster, Member("decode", "d1", restarted.address),
                               TTL_S).start()
        wait_until(lambda: sorted(backend.live_worker_ids()) == ["d1", "p1"])
        assert backend.conductor.decode_ids == ["d1"]
        assert watch.joined == {"p1": fakes[0].address, "d1": restarted.address}
    finally:
        watch.close()
        for reg in regs:
            reg.close()
        for fake in [*fakes, *([restarted] if restarted else [])]:
            fake.close()


def test_unreachable_or_foreign_workers_are_refused(etcd: Etcd, cluster: str,
                                                    backend: DisaggBackend) -> None:
    good = FakeWorker("p1", "prefill").start()
    foreign = FakeWorker("p2", "prefill").start()
    foreign.hello = hello("p2", "prefill", namespace="kvcake/other/b16")
    watch = EtcdWorkers(backend, etcd, cluster, resync_s=1.0).start()
    regs = [Registration(etcd, cluster, Member("prefill", "p1", good.address), TTL_S).start()]
    try:
        with refused_address() as dead:  # held to the end: no other server gets this port
            wait_until(lambda: backend.live_worker_ids() == ["p1"])
            regs.append(Registration(etcd, cluster,
                                     Member("prefill", "p2", foreign.address), TTL_S).start())
            regs.append(Registration(etcd, cluster, Member("decode", "d9", dead), TTL_S).start())
            wait_until(lambda: len(watch.refused) == 2)
            assert "KV namespace" in watch.refused["p2"]
            assert "--advertise-host" in watch.refused["d9"] and dead in watch.refused["d9"]
            assert backend.live_worker_ids() == ["p1"]
            watch.close()  # stops dialling before the port is given back
    finally:
        watch.close()
        for reg in regs:
            reg.close()
        good.close()
        foreign.close()


class _Bound:
    def __init__(self, address: str, worker_id: str = "decode-7") -> None:
        self.address = address
        self.worker_id = worker_id


def test_worker_join_checks_its_advertised_address(etcd: Etcd, cluster: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        bound = f"127.0.0.1:{listener.getsockname()[1]}"
        membership = WorkerMembership(etcd, cluster, "decode", "tiny", "ns")
        with refused_address() as dead, \
                pytest.raises(ValueError, match="--advertise-host: this worker cannot be reached"):
            # nothing listens there: a wrong --advertise-host is caught before registering
            membership.join(_Bound(dead), None)
        assert membership.join(_Bound(bound), None, ("node-decode-7", bound)) == bound
        members = list_members(etcd, cluster)
        assert sorted(m.role for m in members.values()) == ["decode", "store_node"]
        membership.close()
        again = WorkerMembership(etcd, cluster, "decode", "tiny", "ns")  # a restart, same port
        again.join(_Bound(bound), None)
        restarted = list_members(etcd, cluster, "decode")
        old = next(m for m in members.values() if m.role == "decode")
        assert [m.address for m in restarted.values()] == [old.address]
        assert list(restarted.values()) != [old]  # a watcher sees it as a new member
        again.close()
        assert list_members(etcd, cluster) == {}
    assert advertised("0.0.0.0:9000", "10.1.2.3") == "10.1.2.3:9000"
    with pytest.raises(ValueError, match="--advertise-host: the worker binds 0.0.0.0"):
        advertised("0.0.0.0:9000", None)


def test_real_workers_join_through_etcd_and_serve(etcd: Etcd, cluster: str,
                                                  backend: DisaggBackend) -> None:
    """Workers started with `etcd` register (and their store nodes follow the elected master);
    the frontend takes them in and serves greedy tokens equal to the offline engine's, the
    second request reusing the first one's prefix through the store."""
    from kvcake import LLM, SamplingParams
    from kvcake.server.worker.config import Role, WorkerConfig
    from kvcake.server.worker.worker import Worker
    from kvcake.store.elected import ElectedMaster
    from tests.server.test_disagg import ENGINE, ids, run, tokens

    master = ElectedMaster(etcd, cluster, recovery_s=5.0).start()
    assert master.ready.wait(WAIT_S)
    watch = EtcdWorkers(backend, etcd, cluster, resync_s=1.0).start()
    workers = [Worker(WorkerConfig(role=Role(role), engine=ENGINE, etcd=etcd.text, cluster=cluster,
                                   worker_id=f"{role}-x", store_dram_bytes=8 << 20,
                                   num_threads=1)).start() for role in ("prefill", "decode")]
    try:
        wait_until(lambda: sorted(backend.live_worker_ids()) == ["decode-x", "prefill-x"])
        assert sorted(m.member_id for m in list_members(etcd, cluster, "store_node").values()) \
            == ["node-decode-x", "node-prefill-x"]
        shared = ids(5, 64)
        prompts = [shared + ids(6, 9), shared + ids(7, 11)]
        expected = [o.token_ids for o in LLM("tiny", ENGINE).generate(
            prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
        got = [tokens(run(backend, prompt, 6)) for prompt in prompts]
        assert got == expected
    finally:
        watch.close()
        for worker in workers:
            worker.close()
        master.close()

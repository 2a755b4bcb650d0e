"""A worker that hangs without dying: unanswered pings past `worker_timeout_s` fail it like a
dead one (error event to its streams, out of the Conductor, later requests to the survivors)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvcake import LLM
from kvcake.conductor import ConductorConfig
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.cluster.worker_link import WorkerLink
from kvcake.server.frontend.backend import GenerateRequest
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import Hello, Ping
from kvcake.types import RequestId
from tests.server.test_disagg import (
    ENGINE,
    WORKER,
    ids,
    offline,
    profile_dir,
    run,
    tokens,
    wait_until,
)

HELLO = Hello("decode-9", "decode", "tiny", "ns", 16, 100, 4096, 1024, 4, 4096, 2048, 512)


def test_probe_pings_once_per_interval_and_times_out() -> None:
    config = MonitorConfig(worker_timeout_s=10.0, ping_interval_s=1.0)
    ours, theirs = socket.socketpair()
    worker_end = MessageLink(theirs)
    view = WorkerLink.of(HELLO, MessageLink(ours))
    try:
        assert view.probe(0.0, config) is False
        assert worker_end.recv() == Ping(1)
        assert view.probe(5.0, config) is False  # outstanding: no second ping
        view.on_pong(7)  # a stale answer does not count
        assert view.probe(10.0, config) is False  # exactly the timeout: not yet
        assert view.probe(10.5, config) is True
        view.on_pong(1)
        assert view.probe(10.6, config) is False  # answered; the next is due at 11.0
        assert view.probe(11.0, config) is False
        assert worker_end.recv() == Ping(2)
    finally:
        view.link.close()
        worker_end.close()


def test_a_hung_decode_worker_is_failed_and_survivors_serve(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config = ClusterConfig.simple(
        1, 2, engine=ENGINE, worker=dict(WORKER), profile_dir=profile_dir(tmp_path_factory),
        conductor=ConductorConfig.from_dict({"admission": "none"}),
        monitor=MonitorConfig(worker_timeout_s=1.0, ping_interval_s=0.1))
    llm = LLM("tiny", config=ENGINE)
    with Cluster(config, in_process=True) as cluster:
        backend = cluster.backend
        assert backend is not None
        victim = cluster.workers["decode-1"]

        async def stalled_stream() -> tuple[int, str]:
            backend.set_draining("decode-2", True)  # the request must go to the victim
            victim.hold()  # a real stall: its engine loop stops turning, its links stay open
            stream = await backend.generate(GenerateRequest(
                RequestId("hung"), tuple(ids(600, 40)), 50, temperature=0.0, ignore_eos=True))
            assert backend._flights["hung"].placement.decode_id == "decode-1"
            backend.set_draining("decode-2", False)
            seen = 0
            try:
                async for event in stream:
                    seen += len(event.token_ids)
            except RuntimeError as exc:
                return seen, str(exc)
            return seen, ""

        seen, error = asyncio.run(stalled_stream())
        assert seen == 0  # the prefill waits for the KV blocks the stalled worker reserves
        assert error == "decode worker decode-1 failed while serving this request; retry it"
        assert backend.live_worker_ids() == ["prefill-0", "decode-2"]
        assert backend.conductor is not None and backend.conductor.decode_ids == ["decode-2"]
        prompts = [ids(610 + i, 30) for i in range(2)]
        assert [tokens(run(backend, p, 5)) for p in prompts] == offline(llm, prompts, 5)
        victim.release()
        wait_until(lambda: not backend._flights)
        assert backend.live_worker_ids() == ["prefill-0", "decode-2"]  # it stays out

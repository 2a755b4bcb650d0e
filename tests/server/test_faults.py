"""Faults on the disaggregated path: a decode worker killed mid-stream, a failed fetch, a store
node lost. Streams end with a clear error, survivors keep serving, tokens never change."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvcake import LLM
from kvcake.server.cluster.backend import DisaggBackend
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.frontend.backend import GenerateRequest
from kvcake.store import StoreClient
from kvcake.transfer import TransferConfig
from kvcake.types import RequestId
from tests.server.test_disagg import (
    ENGINE,
    cluster_config,
    ids,
    offline,
    run,
    store_blocks,
    tokens,
    wait_until,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(cluster_config(tmp_path_factory, 2, 1), in_process=True) as running:
        yield running


@pytest.fixture
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster for one test that breaks it (its store nodes crash): the shared one stays
    whole for the module's other tests, whatever order they run in."""
    with Cluster(cluster_config(tmp_path_factory, 2, 1), in_process=True) as running:
        yield running


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", config=ENGINE)


def first_on_p0_then_p1(backend: DisaggBackend, first: list[int], second: list[int],
                        between: object) -> tuple[list[int], list[int], int, int]:
    """`first` on prefill-0 (its blocks reach the store), `between()`, then `second` on
    prefill-1, which holds nothing itself. Returns both token lists, the second's cached
    tokens and the tokens it fetched."""
    backend.set_draining("prefill-1", True)
    try:
        tokens_a = tokens(run(backend, first, 8))
        wait_until(lambda: store_blocks(backend, first) == len(first) // 16)
        between()  # type: ignore[operator]
        backend.set_draining("prefill-1", False)
        backend.set_draining("prefill-0", True)
        fetched = backend.totals.num_fetched_tokens
        events = run(backend, second, 8)
    finally:
        backend.set_draining("prefill-0", False)
    return (tokens_a, tokens(events), events[0].num_cached_tokens,
            backend.totals.num_fetched_tokens - fetched)


def test_failed_fetch_falls_back_to_recompute(cluster: Cluster, llm: LLM) -> None:
    backend = cluster.backend
    assert backend is not None and cluster.master_address is not None
    shared = ids(100, 160)
    first, second = shared + ids(101, 20), shared + ids(102, 20)
    ns = backend._hello().namespace
    from kvcake.hashing import block_keys, key_hex

    def drop_from_store() -> None:  # the Conductor still believes the store holds them
        with StoreClient(str(cluster.master_address),
                         transfer_config=TransferConfig(secret=cluster.secret)) as store:
            keys = [f"{ns}:{key_hex(k)}" for k in block_keys(first, 16, ns)]
            assert all(store.remove_batch(keys))

    a, b, cached, fetched = first_on_p0_then_p1(backend, first, second, drop_from_store)
    assert (cached, fetched) == (0, 0)
    assert [a, b] == offline(llm, [first, second], 8)


def test_store_node_lost_costs_hits_never_correctness(own_cluster: Cluster, llm: LLM) -> None:
    cluster = own_cluster
    backend = cluster.backend
    assert backend is not None
    shared = ids(200, 160)
    first, second = shared + ids(201, 20), shared + ids(202, 20)

    def crash_store_nodes() -> None:  # no unregister: the master still lists the replicas
        for worker in cluster.workers.values():
            assert worker.store_node is not None
            worker.store_node.close(unregister=False)

    a, b, cached, fetched = first_on_p0_then_p1(backend, first, second, crash_store_nodes)
    assert (cached, fetched) == (0, 0)
    assert [a, b] == offline(llm, [first, second], 8)


def test_killed_decode_worker_ends_its_streams_and_survivors_serve(
        tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> None:
    config = cluster_config(tmp_path_factory, 1, 2)
    with Cluster(config) as cluster:  # real processes: SIGKILL
        backend = cluster.backend
        assert backend is not None

        async def killed_mid_stream() -> tuple[int, str, str]:
            stream = await backend.generate(GenerateRequest(
                RequestId("long"), tuple(ids(300, 40)), 1500, temperature=0.0, ignore_eos=True))
            victim = backend._flights["long"].placement.decode_id
            seen = 0
            try:
                async for event in stream:
                    seen += len(event.token_ids)
                    if seen == 3:
                        cluster.kill_worker(victim)
            except RuntimeError as exc:
                return seen, victim, str(exc)
            return seen, victim, ""

        seen, victim, error = asyncio.run(killed_mid_stream())
        assert 3 <= seen < 1500
        assert error == (f"decode worker {victim} failed while serving this request; "
                         "retry it")
        wait_until(lambda: victim not in backend.live_worker_ids())
        prompts = [ids(310 + i, 30) for i in range(3)]
        outputs = [tokens(run(backend, p, 6)) for p in prompts]
        assert outputs == offline(llm, prompts, 6)
        survivors = backend.live_worker_ids()
        assert victim not in survivors and len(survivors) == 2
        processes = list(cluster.processes.values())
    assert all(proc.poll() is not None for proc in processes)  # no orphans

"""Store evictions reach the Conductor: blocks the store dropped (removed, evicted, or lost with
a node) stop being listed under holder "store", through the frontend's bounded audit."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from kvcake import LLM
from kvcake.conductor import ConductorConfig
from kvcake.hashing import block_keys
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.cluster.store_audit import StoreAudit
from kvcake.store import StoreClient
from kvcake.transfer import TransferConfig
from tests.server.test_disagg import (
    ENGINE,
    WORKER,
    ids,
    offline,
    profile_dir,
    run,
    store_blocks,
    tokens,
    wait_until,
)

# -- the bookkeeping alone ---------------------------------------------------------------------


def test_rounds_are_bounded_and_round_robin() -> None:
    audit = StoreAudit("ns", max_keys=2)
    assert audit.track([10, 11, 12]) == []
    first = audit.take_round()
    assert [k for k, _ in first] == [10, 11]
    assert [k for k, _ in audit.take_round()] == [12, 10]
    assert audit.settle(first, [True, False]) == [11]
    assert len(audit) == 2 and (audit.num_checked, audit.num_removed) == (2, 1)
    assert [k for k, _ in audit.take_round()] == [12, 10]  # 11 is no longer tracked


def test_a_key_stored_again_while_checked_stays_listed() -> None:
    audit = StoreAudit("ns", max_keys=4)
    audit.track([1, 2])
    batch = audit.take_round()
    audit.track([1])  # written again after the master answered "gone"
    assert audit.settle(batch, [False, False]) == [2]
    assert [k for k, _ in audit.take_round()] == [1]


def test_suspects_go_first_and_tracking_is_bounded() -> None:
    audit = StoreAudit("ns", max_keys=1, max_tracked=3)
    audit.track([1, 2, 3])
    audit.suspect([3, 99])  # 99 is not tracked: ignored
    assert [k for k, _ in audit.take_round()] == [3]
    assert audit.track([4]) == [1]  # over max_tracked: the least recently checked goes
    assert audit.store_key(255) == "ns:" + "0" * 14 + "ff"
    with pytest.raises(ValueError, match="max_keys: must be >= 1"):
        StoreAudit("ns", max_keys=0)


def test_a_silent_master_skips_the_round_and_loses_nothing() -> None:
    audit = StoreAudit("ns", max_keys=2)
    audit.track([1, 2, 3])
    reported: list[list[int]] = []

    def down(keys: object) -> list[bool]:
        raise OSError("connection refused")

    assert audit.run_round(down, threading.Lock(), reported.append) == []
    assert len(audit) == 3 and reported == []
    asked: list[list[str]] = []

    def answer(keys: Sequence[str]) -> list[bool]:
        asked.append(list(keys))
        return [key.endswith("1") for key in keys]

    assert audit.run_round(answer, threading.Lock(), reported.append) == [3]
    assert asked == [[audit.store_key(3), audit.store_key(1)]] and reported == [[3]]


def test_monitor_config_names_the_bad_key() -> None:
    with pytest.raises(ValueError, match="monitor.worker_timeout_s: must be a number > 0"):
        MonitorConfig(worker_timeout_s=0)
    with pytest.raises(ValueError, match="ping_interval_s: must be below worker_timeout_s"):
        MonitorConfig(worker_timeout_s=1.0, ping_interval_s=2.0)
    with pytest.raises(ValueError, match=r"\[monitor\]: unknown keys \['timeout'\]"):
        ClusterConfig.from_dict({"monitor": {"timeout": 3},
                                 "workers": [{"role": "prefill"}, {"role": "decode"}]})
    config = ClusterConfig.from_dict({"monitor": {"worker_timeout_s": 5},
                                      "workers": [{"role": "prefill"}, {"role": "decode"}]})
    assert config.monitor == MonitorConfig(worker_timeout_s=5)


# -- on a live cluster ---------------------------------------------------------------------------


def _cluster(factory: pytest.TempPathFactory) -> Cluster:
    # The monitor thread never audits by itself here: each test runs the rounds it checks.
    config = ClusterConfig.simple(
        2, 1, engine=ENGINE, worker=dict(WORKER), profile_dir=profile_dir(factory),
        conductor=ConductorConfig.from_dict({"admission": "none"}),
        monitor=MonitorConfig(store_audit_interval_s=3600.0, store_audit_max_keys=8))
    return Cluster(config, in_process=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with _cluster(tmp_path_factory) as running:
        yield running


@pytest.fixture
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster for one test that breaks it (its store nodes leave): the shared one stays
    whole for the module's other tests, whatever order they run in."""
    with _cluster(tmp_path_factory) as running:
        yield running


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", config=ENGINE)


def _store_keys(cluster: Cluster, prompt: list[int]) -> list[str]:
    assert cluster.backend is not None
    ns = cluster.backend._hello().namespace
    audit = cluster.backend.store_audit
    assert audit is not None
    return [audit.store_key(k) for k in block_keys(prompt, ENGINE.block_size, ns)]


def _audit_until_quiet(cluster: Cluster) -> list[int]:
    """Audit rounds until one full cycle found nothing more; all keys found gone, in order."""
    assert cluster.backend is not None and cluster.backend.store_audit is not None
    gone: list[int] = []
    for _ in range(-(-len(cluster.backend.store_audit) // 8) + 1):
        gone += cluster.backend.audit_store()
    return gone


def test_removed_blocks_leave_the_index_and_no_fetch_is_planned(cluster: Cluster,
                                                                llm: LLM) -> None:
    backend = cluster.backend
    assert backend is not None and cluster.master_address is not None
    shared = ids(500, 160)  # 10 blocks
    first, second = shared + ids(501, 20), shared + ids(502, 20)
    backend.set_draining("prefill-1", True)
    try:
        tokens_a = tokens(run(backend, first, 6))
        wait_until(lambda: store_blocks(backend, first) == 11)
        assert _audit_until_quiet(cluster) == []  # everything is there: nothing reported
        with StoreClient(cluster.master_address,
                         transfer_config=TransferConfig(secret=cluster.secret)) as store:
            assert all(store.remove_batch(_store_keys(cluster, first)[4:]))
        ns = backend._hello().namespace
        expected = [int(k) for k in block_keys(first, ENGINE.block_size, ns)[4:]]
        assert sorted(_audit_until_quiet(cluster)) == sorted(expected)
        assert store_blocks(backend, first) == 4  # the prefix still in the store
        backend.set_draining("prefill-1", False)
        backend.set_draining("prefill-0", True)
        fetched = backend.totals.num_fetched_tokens
        events = run(backend, second, 6)
    finally:
        backend.set_draining("prefill-0", False)
    # Only the 4 blocks still in the store were planned and fetched: no failed fetch.
    assert backend.totals.num_fetched_tokens - fetched == 4 * 16
    assert events[0].num_cached_tokens == 4 * 16
    assert [tokens_a, tokens(events)] == offline(llm, [first, second], 6)


def test_a_store_node_that_leaves_takes_its_blocks_out_of_the_index(
        own_cluster: Cluster) -> None:
    cluster = own_cluster
    backend = cluster.backend
    assert backend is not None
    prompt = ids(510, 64)  # 4 blocks, written from prefill-0's node
    backend.set_draining("prefill-1", True)
    try:
        run(backend, prompt, 2)
        wait_until(lambda: store_blocks(backend, prompt) == 4)
    finally:
        backend.set_draining("prefill-1", False)
    for worker in cluster.workers.values():  # every node leaves: the master drops the replicas
        assert worker.store_node is not None
        worker.store_node.close()
    _audit_until_quiet(cluster)
    assert store_blocks(backend, prompt) == 0
    assert backend.store_audit is not None and len(backend.store_audit) == 0

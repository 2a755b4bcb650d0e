"""`kvcake serve`'s supervision with real worker processes (tiny preset): a SIGKILLed decode
worker is reaped (its shared memory unlinked), restarted, its store node registered again and
back in the Conductor; a SIGSTOPped prefill worker is declared lost, killed and replaced; the
tokens after each equal the offline engine's."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator

import pytest

from kvcake import LLM
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.cluster.restart_policy import RestartPolicy
from kvcake.transfer.segment import SHM_DIR, block_prefix
from tests.server.test_disagg import ENGINE, cluster_config, ids, offline, run, tokens, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = dataclasses.replace(cluster_config(tmp_path_factory, 1, 1),
                                 monitor=MonitorConfig(worker_timeout_s=3.0, ping_interval_s=0.5))
    with Cluster(config, restart=RestartPolicy(backoff_s=0.2)) as running:
        yield running


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", config=ENGINE)


def served_right(cluster: Cluster, llm: LLM, seed: int) -> None:
    assert cluster.backend is not None
    prompt = ids(seed, 45)
    assert tokens(run(cluster.backend, prompt, 6)) == offline(llm, [prompt], 6)[0]


def test_a_killed_decode_worker_is_restarted_and_rejoins(cluster: Cluster, llm: LLM) -> None:
    assert cluster.backend is not None and cluster.supervisor is not None
    assert cluster.master is not None
    served_right(cluster, llm, 1)
    old_pid = cluster.signal_worker("decode-1", signal.SIGKILL)
    wait_until(lambda: cluster.supervisor is not None
               and cluster.supervisor.restarts.get("decode-1") == 1, timeout_s=120)
    [(worker_id, _pid, code, _unlinked)] = [r for r in cluster.supervisor.reaped
                                            if r[1] == old_pid]
    assert (worker_id, code) == ("decode-1", -signal.SIGKILL)
    # Its KV pool and store segment are gone once it is reaped (unlinked by the supervisor,
    # or earlier by the dead process's resource tracker).
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(block_prefix(old_pid))]
    assert cluster.processes["decode-1"].pid != old_pid
    assert sorted(cluster.backend.live_worker_ids()) == ["decode-1", "prefill-0"]
    assert "node-decode-1" in cluster.master.service.index.nodes  # registered again
    served_right(cluster, llm, 2)


def test_a_stopped_prefill_worker_is_declared_lost_then_replaced(cluster: Cluster,
                                                                 llm: LLM) -> None:
    assert cluster.backend is not None and cluster.supervisor is not None
    old_pid = cluster.signal_worker("prefill-0", signal.SIGSTOP)
    wait_until(lambda: cluster.supervisor is not None
               and cluster.supervisor.restarts.get("prefill-0") == 1, timeout_s=120)
    assert cluster.processes["prefill-0"].pid != old_pid
    assert sorted(cluster.backend.live_worker_ids()) == ["decode-1", "prefill-0"]
    assert not cluster.supervisor.failures
    served_right(cluster, llm, 3)

"""A CPP group whose two stages run on two hosts (network namespaces b and c, each its own
hostname, so nothing crosses through shared memory): stage 0 on b writes each chunk's hidden
states into stage 1's inbox on c over TCP, both stream their layers' KV over TCP into the decode
worker's blocks (this process, on the bridge's address), where the frontend and the store master
run too. Checked: the greedy tokens of a prompt of 6 chunks equal the offline engine's; a second
prompt sharing its first 160 tokens is served with that prefix read by both stages from the
store (over TCP), only its 70 new tokens pipelined, and the same tokens as the offline engine.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcake import LLM, auth
from kvcake.auth import ClusterSecret
from kvcake.conductor import ConductorConfig
from kvcake.server.cluster.backend import DisaggBackend, DisaggConfig
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.worker import Worker
from kvcake.store import MasterServer, MasterService
from tests.multihost.netns import NetnsHosts
from tests.server.cluster.fakes import DECODE, PREFILL
from tests.server.test_disagg import ENGINE, ids, offline, run, store_blocks, tokens, wait_until

CHUNK = 40
CPP = {"admission": "none", "cpp_min_tokens": 100, "cpp_nodes": 2, "cpp_chunk_tokens": CHUNK,
       "cpp_min_chunk_tokens": 16}
STAGE_PORT = 24210  # each host is its own network namespace: the same port on both


def stage_argv(hosts: NetnsHosts, host: str, member: int, master: str) -> list[str]:
    return [sys.executable, "-m", "kvcake", "worker", "--role", "cpp", "--cpp-member",
            str(member), "--cpp-nodes", "2", "--cpp-chunk-tokens", str(CHUNK), "--host",
            hosts.ip(host), "--port", str(STAGE_PORT), "--worker-id", f"cpp-{host}",
            "--master", master, "--num-threads", "1", "--store-dram-bytes", "16MiB",
            "--kv-cache-bytes", str(ENGINE.kv_cache_bytes), "--max-num-batched-tokens",
            str(ENGINE.max_num_batched_tokens)]


def await_ready(log: Path, timeout_s: float = 60.0) -> str:
    """The address a worker prints once it serves (its log, written by `NetnsHosts.spawn`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if line.startswith("kvcake worker ready"):
                return line.split()[-1]
        time.sleep(0.1)
    raise AssertionError(f"{log.name}: the worker did not start in {timeout_s} s")


@pytest.fixture
def cluster(hosts: NetnsHosts, tmp_path: Path) -> Iterator[DisaggBackend]:
    secret = ClusterSecret.generate()
    master = MasterServer(MasterService(), hosts.root_ip, 0, secret=secret).start()
    decode: Worker | None = None
    backend: DisaggBackend | None = None
    try:
        env = {**os.environ, auth.ENV_VAR: secret.text()}
        for member, host in enumerate(("b", "c")):  # both start while the decode worker loads
            hosts.spawn(host, stage_argv(hosts, host, member, master.address), name=f"cpp-{host}",
                        env=env)
        decode = Worker(WorkerConfig(role=Role.DECODE, model="tiny", engine=ENGINE,
                                     host=hosts.root_ip, port=0, worker_id="decode-0",
                                     master=master.address, secret=secret,
                                     store_dram_bytes=16 * 2**20)).start()
        stages = [await_ready(tmp_path / f"cpp-{host}.log") for host in ("b", "c")]
        assert stages == [f"{hosts.ip(h)}:{STAGE_PORT}" for h in ("b", "c")]
        backend = DisaggBackend(DisaggConfig(
            model="tiny", worker_addresses=(decode.address, *stages),
            conductor=ConductorConfig.from_dict(CPP), store_master=master.address,
            secret=secret), PREFILL, DECODE).start()
        yield backend
    finally:
        if backend is not None:
            backend.close()
        if decode is not None:
            decode.close()
        hosts.stop_processes()
        master.close()


def test_cpp_stages_on_two_hosts_equal_the_single_engine(cluster: DisaggBackend) -> None:
    backend = cluster
    assert backend.conductor is not None
    assert backend.conductor.cpp_groups == (("cpp-b", "cpp-c"),)
    llm = LLM("tiny", config=ENGINE)
    first = ids(140, 230)  # 6 chunks (5 x 40 + 30)
    events = run(backend, first, 8)
    assert tokens(events) == offline(llm, [first], 8)[0]
    assert events[0].num_cached_tokens == 0
    # Each stage writes its layers of the group's prompt to the store; a second prompt sharing
    # its first 160 tokens (10 blocks) reads them there, each stage its own slices, over TCP.
    wait_until(lambda: store_blocks(backend, first) == 230 // 16)
    second = first[:160] + ids(141, 70)
    events = run(backend, second, 8)
    assert tokens(events) == offline(llm, [second], 8)[0]
    assert events[0].num_cached_tokens == 160

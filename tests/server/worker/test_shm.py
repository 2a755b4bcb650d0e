"""Same-host KV streaming: the decode engine's KV pool is a shared-memory segment, so a prefill
worker on this host writes each layer into the reserved blocks by memcpy through its mapping (no
per-slice digest), and over TCP (each slice with a digest) when either side has shared memory off.
The block is unlinked when the decode worker stops, and by the resource tracker when it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvcake import LLM, SamplingParams
from kvcake.engine.config import EngineConfig
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    DecodeAdmitted,
    DecodeOrder,
    Hello,
    KvReserved,
    PrefillDone,
    PrefillOrder,
    RequestFailed,
    ReserveKv,
    Tokens,
)
from kvcake.server.worker.worker import Worker
from kvcake.transfer import (
    EndpointKey,
    SegmentDesc,
    TransferConfig,
    TransferEngine,
    TransferError,
    Transport,
    TransportKind,
)
from kvcake.transfer.segment import SHM_DIR
from tests.server.worker.links import next_of

ENGINE = EngineConfig(kv_cache_bytes=4 * 2**20)
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPT = np.random.default_rng(11).integers(0, 256, 40).tolist()  # 3 blocks of 16


@dataclass(frozen=True)
class Write:
    kind: TransportKind
    peer: str
    segment: str
    offset: int
    length: int
    digest: bool  # the slice carried a digest the destination checks


class Recording:
    """A transport that notes every write it passes on."""

    def __init__(self, inner: Transport, key: EndpointKey, writes: list[Write]) -> None:
        self.inner, self.key, self.writes = inner, key, writes

    def read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
             checksum: object) -> int | None:
        return self.inner.read(segment, offset, dest, checksum=checksum)  # type: ignore[arg-type]

    def write(self, segment: SegmentDesc, offset: int, src: memoryview, *, checksum: object,
              digest: int | None) -> None:
        self.writes.append(Write(self.key.kind, self.key.peer, segment.name, offset, len(src),
                                 checksum is not None))
        self.inner.write(segment, offset, src, checksum=checksum,  # type: ignore[arg-type]
                         digest=digest)

    def close(self) -> None:
        self.inner.close()


def serve_one(decode: Worker, prefill: Worker) -> tuple[KvReserved, list[int]]:
    """Reserve on `decode`, prefill on `prefill` into the reservation, decode: the reservation
    and the generated tokens. Checks that the KV landed in the reserved blocks."""
    assert decode.engine is not None
    d_link, p_link = MessageLink.connect(decode.address), MessageLink.connect(prefill.address)
    try:
        assert next_of(d_link, Hello).worker_id == decode.worker_id
        assert next_of(p_link, Hello).worker_id == prefill.worker_id
        d_link.send(ReserveKv("r", PROMPT, SAMPLING))
        reserved = next_of(d_link, KvReserved)
        assert reserved.request_id == "r" and len(reserved.block_ids) == 3
        pool = decode.engine.pool.kv
        pool[:, reserved.block_ids] = float("nan")  # only the transfer can make them finite
        p_link.send(PrefillOrder("r", PROMPT, SAMPLING, [], reserved.kv_pool,
                                 reserved.block_ids, reserved.num_pool_blocks))
        done = next_of(p_link, PrefillDone, RequestFailed)
        assert isinstance(done, PrefillDone), done
        assert bool(torch.isfinite(pool[:, reserved.block_ids]).all())
        others = [b for b in range(decode.engine.num_blocks) if b not in reserved.block_ids]
        assert not bool(pool[:, others].any())  # nothing outside the reservation was written
        d_link.send(DecodeOrder("r", PROMPT, done.first_token_id, SAMPLING,
                                done.sampler_state))
        assert next_of(d_link, DecodeAdmitted, RequestFailed) == DecodeAdmitted("r")
        generated = [done.first_token_id]
        while True:
            tokens = next_of(d_link, Tokens)
            assert tokens.request_id == "r"
            generated += tokens.token_ids
            if tokens.finish_reason is not None:
                return reserved, generated
    finally:
        d_link.close()
        p_link.close()


def offline_tokens() -> list[int]:
    out = LLM("tiny", config=ENGINE).generate([PROMPT], SamplingParams(max_tokens=6,
                                                                       ignore_eos=True))
    return out[0].token_ids


def expected_ranges(decode: Worker, block_ids: list[int]) -> set[tuple[int, int]]:
    """(offset, length) of every layer of every reserved block in the pool segment."""
    assert decode.engine is not None
    pool = decode.engine.pool
    return {(pool.layer_offset_bytes(b, layer), pool.layer_nbytes)  # type: ignore[arg-type]
            for b in block_ids for layer in range(pool.num_layers)}


def covered(writes: list[Write], ranges: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The ranges the writes filled. A write may span several adjacent ranges (a run of
    consecutive blocks of one layer is one request), but every byte must lie inside one."""
    filled: dict[tuple[int, int], int] = {}
    for w in writes:
        at, end = w.offset, w.offset + w.length
        while at < end:
            owner = [r for r in ranges if r[0] <= at < r[0] + r[1]]
            assert len(owner) == 1, f"write [{w.offset}, +{w.length}) outside the reserved blocks"
            step = min(end, owner[0][0] + owner[0][1]) - at
            filled[owner[0]] = filled.get(owner[0], 0) + step
            at += step
    return {r for r, n in filled.items() if n == r[1]}


def test_same_host_kv_goes_through_shared_memory_into_the_reserved_blocks() -> None:
    writes: list[Write] = []
    decode = Worker(WorkerConfig(role=Role.DECODE, engine=ENGINE, worker_id="ds0")).start()
    try:
        with Worker(WorkerConfig(role=Role.PREFILL, engine=ENGINE, worker_id="ps0"),
                    wrap_transport=lambda t, k, r: Recording(t, k, writes)) as prefill:
            assert decode.engine is not None and decode.transfer is not None
            segment = decode.transfer.segment("kv-pool-ds0")
            assert segment.array.ctypes.data == decode.engine.pool.kv.data_ptr()  # no copy
            reserved, generated = serve_one(decode, prefill)
            shm_name = reserved.kv_pool["shm_name"]
            assert shm_name == segment.shm_name and os.path.exists(f"{SHM_DIR}/{shm_name}")
            ranges = expected_ranges(decode, reserved.block_ids)
            assert covered(writes, ranges) == ranges
            assert sum(w.length for w in writes) == 3 * decode.engine.pool.block_nbytes
            assert {(w.kind, w.peer, w.segment, w.digest) for w in writes} == {
                (TransportKind.SHM, shm_name, "kv-pool-ds0", False)}
    finally:
        decode.close()
    assert not os.path.exists(f"{SHM_DIR}/{shm_name}")  # unlinked when the worker stopped
    assert generated == offline_tokens()


@pytest.mark.parametrize(("decode_shm", "prefill_shm"), [(True, False), (False, True)])
def test_without_shared_memory_on_either_side_the_kv_goes_over_tcp_with_digests(
        decode_shm: bool, prefill_shm: bool) -> None:
    writes: list[Write] = []
    with Worker(WorkerConfig(role=Role.DECODE, engine=ENGINE, worker_id="dt0",
                             shared_memory=decode_shm)) as decode, \
            Worker(WorkerConfig(role=Role.PREFILL, engine=ENGINE, worker_id="pt0",
                                shared_memory=prefill_shm),
                   wrap_transport=lambda t, k, r: Recording(t, k, writes)) as prefill:
        assert decode.transfer is not None and decode.engine is not None
        reserved, generated = serve_one(decode, prefill)
        assert (reserved.kv_pool["shm_name"] is not None) is decode_shm
        ranges = expected_ranges(decode, reserved.block_ids)
        assert covered(writes, ranges) == ranges
        assert {(w.kind, w.peer, w.segment, w.digest) for w in writes} == {
            (TransportKind.TCP, decode.transfer.address, "kv-pool-dt0", True)}
    assert generated == offline_tokens()


def test_a_killed_decode_workers_pool_is_unlinked_so_no_write_lands_in_it() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcake", "worker", "--role", "decode", "--worker-id", "dk0",
         "--kv-cache-bytes", "4MiB", "--num-threads", "1"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready[:3] == ["kvcake", "worker", "ready"], ready
        link = MessageLink.connect(ready[4])
        try:
            assert next_of(link, Hello).worker_id == "dk0"
            link.send(ReserveKv("r", PROMPT, SAMPLING))
            reserved = next_of(link, KvReserved)
            assert reserved.request_id == "r" and reserved.kv_pool["name"] == "kv-pool-dk0"
        finally:
            link.close()
        path = f"{SHM_DIR}/{reserved.kv_pool['shm_name']}"
        pool = SegmentDesc.from_dict(reserved.kv_pool)
        with TransferEngine(TransferConfig(serve=False)) as writer:  # a prefill worker's
            writer.write(pool, 0, b"\x01" * 64)  # mapped now, before the decode worker dies
            os.kill(proc.pid, signal.SIGKILL)  # not its group: its resource tracker lives on
            proc.wait(timeout=30)
            deadline = time.monotonic() + 30  # the resource tracker notices its parent is gone
            while os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not os.path.exists(path)
            with pytest.raises(TransferError, match="was unlinked"):
                writer.write(pool, 0, b"\x02" * 64)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

"""Shared-memory transport: same-host segments are mapped, not sent over TCP."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest

from kvcake.transfer import (
    EndpointKey,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransportKind,
)
from kvcake.transfer.segment import SHM_DIR
from tests.transfer.conftest import SERVER_CONFIG

SHM_CLIENT = TransferConfig(serve=False, num_rails=2, slice_bytes=4096, checksum_shm=True,
                            inline_max_slices=0)


def test_round_trip_through_a_mapped_segment(server: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 32 * 1024)
    assert desc.shm_name is not None
    data = np.random.default_rng(1).integers(0, 256, 20_000, dtype=np.uint8)
    with TransferEngine(SHM_CLIENT) as client:
        client.write(desc, 5, data)
        assert np.array_equal(server.segment("dram").array[5:20_005], data)
        out = np.zeros(20_000, np.uint8)
        client.read(desc, 5, out)
        assert np.array_equal(out, data)
        assert client.endpoint_keys(0) == [EndpointKey(TransportKind.SHM, desc.shm_name)]


def test_private_memory_goes_over_tcp_and_shm_can_be_turned_off(server: TransferEngine) -> None:
    private = server.allocate_segment("private", 4096, shared=False)
    shared = server.allocate_segment("shared", 4096)
    assert private.shm_name is None
    with TransferEngine(TransferConfig(serve=False, num_rails=1, use_shared_memory=False,
                                       inline_max_slices=0)) as c:
        c.read(shared, 0, bytearray(8))
        c.read(private, 0, bytearray(8))
        assert c.endpoint_keys(0) == [EndpointKey(TransportKind.TCP, server.address)]


def test_a_caller_owned_shared_memory_block_can_be_registered(server: TransferEngine) -> None:
    block = shared_memory.SharedMemory(create=True, size=8192)
    try:
        desc = server.register_segment("user", block)
        assert desc.shm_name == block.name and desc.length_bytes == 8192
        with TransferEngine(SHM_CLIENT) as client:
            client.write(desc, 100, b"hello")
        assert bytes(memoryview(block.buf)[100:105]) == b"hello"  # type: ignore[arg-type]
        server.unregister_segment("user")
    finally:
        block.close()
        block.unlink()


def test_an_unlinked_segment_fails_cleanly(server: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 4096)
    server.unregister_segment("dram")
    with TransferEngine(SHM_CLIENT) as client, pytest.raises(TransferError,
                                                             match="cannot open shared memory"):
        client.read(desc, 0, bytearray(8))


def test_a_mapped_segment_whose_owner_unlinks_it_is_never_read_stale(
        server: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 4096)
    with TransferEngine(SHM_CLIENT) as client:
        client.write(desc, 0, b"old")  # the mapping is now pooled on the rail
        server.unregister_segment("dram")
        with pytest.raises(TransferError, match="was unlinked"):
            client.read(desc, 0, bytearray(3))


def test_close_unlinks_the_segments_the_engine_allocated() -> None:
    with TransferEngine(SERVER_CONFIG) as engine:
        name = engine.allocate_segment("dram", 4096).shm_name
        assert name is not None
        path = f"{SHM_DIR}/{name}"
        assert open(path, "rb").read(1) == b"\x00"
    with pytest.raises(FileNotFoundError):
        open(path, "rb")


def _serve_in_child(queue: Any, stop: Any) -> None:
    with TransferEngine(SERVER_CONFIG) as engine:
        desc = engine.allocate_segment("dram", 1 << 20)
        engine.segment("dram").array[:] = 7
        queue.put(desc.to_dict())
        stop.wait(30)


def test_another_process_segment_over_shm_and_tcp() -> None:
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve_in_child, args=(queue, stop))
    child.start()
    try:
        from kvcake.transfer import SegmentDesc

        desc = SegmentDesc.from_dict(queue.get(timeout=60))
        for config in (SHM_CLIENT, TransferConfig(serve=False, use_shared_memory=False)):
            with TransferEngine(config) as client:
                out = np.zeros(1 << 20, np.uint8)
                client.read(desc, 0, out)
                assert (out == 7).all()
                client.write(desc, 0, b"\x01" * 10)
                client.read(desc, 0, out[:11])
                assert out[:11].tolist() == [1] * 10 + [7]
                client.write(desc, 0, b"\x07" * 10)
    finally:
        stop.set()
        child.join(30)
    assert child.exitcode == 0

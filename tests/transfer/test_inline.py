"""The synchronous fast path: small batches move on the caller's thread, retries on the rails."""

from __future__ import annotations

import threading

import numpy as np

from kvcake.transfer import (
    EndpointKey,
    FaultSpec,
    FaultyTransport,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    Transport,
    TransportKind,
)

CONFIG = TransferConfig(serve=False, use_shared_memory=False, num_rails=2, slice_bytes=4096,
                        inline_max_slices=2)


def test_small_batches_run_on_the_calling_thread(server: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 64 * 1024)
    threads: list[str] = []

    def wrap(t: Transport, key: EndpointKey, rail: int) -> Transport:
        threads.append(threading.current_thread().name)
        return t

    with TransferEngine(CONFIG, wrap_transport=wrap) as client:
        client.write(desc, 0, b"a" * 8192)  # 2 slices: inline
        assert threads == [threading.current_thread().name]
        assert client.endpoint_keys(0) == client.endpoint_keys(1) == []
        client.write(desc, 0, b"b" * 12288)  # 3 slices: the rails
        assert sorted(threads[1:]) == ["kvcake-rail-0", "kvcake-rail-1"]
        batch = client.submit([TransferRequest(TransferOp.READ, bytearray(8), desc)])
        client.wait(batch)  # submit never runs inline: it must return at once
        assert len(threads) == 3
    assert bytes(server.segment("dram").array[:12288]) == b"b" * 12288


def test_an_inline_failure_is_retried_on_a_rail(server: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 4096)
    server.segment("dram").array[:] = np.arange(4096) % 256
    caller = threading.current_thread().name

    def wrap(t: Transport, key: EndpointKey, rail: int) -> Transport:
        dead = threading.current_thread().name == caller
        return FaultyTransport(t, FaultSpec(drop_rate=1.0 if dead else 0.0))

    with TransferEngine(CONFIG, wrap_transport=wrap) as client:
        out = bytearray(4096)
        client.read(desc, 0, out)
        assert out == (np.arange(4096) % 256).astype(np.uint8).tobytes()
        assert client.endpoint_keys(1) == [EndpointKey(TransportKind.TCP, desc.address)]

"""The faulty transport never gets corrupted bytes past the engine: a request either fails or
delivers exactly the source bytes, whatever the drops and bit flips."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcake.transfer import (
    EndpointKey,
    FaultSpec,
    FaultyTransport,
    RequestState,
    SegmentDesc,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
    Transport,
)
from tests.transfer.conftest import SERVER_CONFIG

SEGMENT_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def owner() -> Iterator[tuple[TransferEngine, SegmentDesc]]:
    with TransferEngine(SERVER_CONFIG) as engine:
        yield engine, engine.allocate_segment("dram", SEGMENT_BYTES)


def faulty_client(spec: FaultSpec, seed: int, shm: bool, checksums: bool = True,
                  inline: bool = False) -> TransferEngine:
    config = TransferConfig(serve=False, use_shared_memory=shm, num_rails=3, slice_bytes=4096,
                            max_retries=8, checksum_shm=checksums, checksum_tcp=checksums,
                            inline_max_slices=1000 if inline else 0)
    injected: list[FaultyTransport] = []

    def wrap(t: Transport, key: EndpointKey, rail: int) -> Transport:
        injected.append(FaultyTransport(t, spec, seed=seed * 31 + rail))
        return injected[-1]

    engine = TransferEngine(config, wrap_transport=wrap)
    engine.injected = injected  # type: ignore[attr-defined]
    return engine


transfers = st.tuples(
    st.integers(0, SEGMENT_BYTES - 1).flatmap(
        lambda off: st.tuples(st.just(off), st.integers(1, min(20_000, SEGMENT_BYTES - off)))),
    st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.integers(0, 2**16), st.booleans(),
    st.sampled_from([TransferOp.READ, TransferOp.WRITE]), st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(transfers)
def test_delivered_bytes_are_always_the_source_bytes(
        owner: tuple[TransferEngine, SegmentDesc], case: tuple) -> None:  # type: ignore[type-arg]
    (offset, length), drop, corrupt, seed, shm, op, inline = case
    engine, desc = owner
    rng = np.random.default_rng(seed)
    segment = engine.segment("dram").array
    segment[:] = rng.integers(0, 256, SEGMENT_BYTES, dtype=np.uint8)
    data = rng.integers(0, 256, length, dtype=np.uint8)
    local = data.copy() if op is TransferOp.WRITE else np.zeros(length, np.uint8)
    request = TransferRequest(op, local, desc, offset)
    spec = FaultSpec(drop_rate=drop, corrupt_rate=corrupt)
    with faulty_client(spec, seed, shm, inline=inline) as client:
        if inline:  # the synchronous call: slices start on this thread, retries on the rails
            try:
                client.transfer([request], timeout_s=60)
                error = None
            except TransferError as e:
                error = str(e)
        else:
            status = client.wait(client.submit([request]), 60)
            error = status.requests[0].error
            assert (error is None) == (status.requests[0].state is RequestState.DONE)
    if error is None:
        source = data if op is TransferOp.WRITE else segment[offset:offset + length]
        target = segment[offset:offset + length] if op is TransferOp.WRITE else local
        assert np.array_equal(source, target)
    else:
        assert "failed after 9 attempts" in error


@pytest.mark.parametrize("shm", [False, True])
def test_without_checksums_corruption_would_get_through(
        owner: tuple[TransferEngine, SegmentDesc], shm: bool) -> None:
    engine, desc = owner
    engine.segment("dram").array[:] = 0
    out = np.zeros(8192, np.uint8)
    with faulty_client(FaultSpec(corrupt_rate=1.0), 0, shm, checksums=False) as client:
        client.read(desc, 0, out)
    assert np.count_nonzero(out) == 2  # one flipped bit per 4 KiB slice, undetected
    out = np.zeros(SEGMENT_BYTES, np.uint8)
    with faulty_client(FaultSpec(corrupt_rate=0.5), 0, shm) as client:
        client.read(desc, 0, out)
        assert sum(t.num_corrupted for t in client.injected) > 0  # type: ignore[attr-defined]
    assert np.count_nonzero(out) == 0  # with checksums: flips detected and retried

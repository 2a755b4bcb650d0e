"""Fixtures for transfer tests: a serving engine and a client engine, on ports 20200-20499."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcake.transfer import TransferConfig, TransferEngine

SERVER_CONFIG = TransferConfig(port=20200, port_search=300, num_rails=2, io_timeout_s=10.0)
TCP_CLIENT_CONFIG = TransferConfig(serve=False, use_shared_memory=False, num_rails=2,
                                   slice_bytes=4096, io_timeout_s=10.0, inline_max_slices=0)


@pytest.fixture
def server() -> Iterator[TransferEngine]:
    with TransferEngine(SERVER_CONFIG) as engine:
        yield engine


@pytest.fixture
def client() -> Iterator[TransferEngine]:
    """Reaches every segment over TCP, with 4 KiB slices so small transfers stripe, always on the
    rail threads (no inline fast path: tests/transfer/test_inline.py covers that)."""
    with TransferEngine(TCP_CLIENT_CONFIG) as engine:
        yield engine

"""Addresses for tests that must find nobody listening.

Binding port 0, closing the socket and then dialling the port is a race: until the dial, any
process on the machine (or another thread of this one) may be given that port, and the dial
then reaches it: a test's client connected to someone else's server (another test run's worker,
whose link it would take over). `refused_address()` keeps the port bound, without listening,
for as long as the test needs it: nobody else can bind it, and a dial is refused at once.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def refused_address(host: str = "127.0.0.1") -> Iterator[str]:
    """"HOST:PORT" where a connection is refused (ECONNREFUSED) until the block ends."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))  # no SO_REUSEADDR and no listen(): held, and refused
        yield f"{host}:{sock.getsockname()[1]}"

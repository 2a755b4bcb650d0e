"""Deferred one-way requests (lease releases) ride with the connection's next request."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvcake.store.protocol import RpcConnection
from kvcake.store.rpc_server import RpcServer


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.released = threading.Event()

    def __call__(self, op: str, args: dict[str, Any], session: dict[str, Any]) -> Any:
        self.calls.append((op, args))
        if op == "release_leases":
            self.released.set()
        return {"calls": len(self.calls)}


def test_a_deferred_release_is_handled_before_the_next_request() -> None:
    recorder = Recorder()
    server = RpcServer(recorder).start()
    conn = RpcConnection(server.address)
    try:
        conn.defer("release_leases", leases=[["a", 1]])
        conn.defer("release_leases", leases=[["b", 2]])
        assert conn.call("stats") == {"calls": 3}  # both releases went first, in order
        assert recorder.calls == [("release_leases", {"leases": [["a", 1]]}),
                                  ("release_leases", {"leases": [["b", 2]]}), ("stats", {})]
        with pytest.raises(ValueError, match="answered"):
            conn.defer("get", key="a")  # only one-way ops may be deferred
        conn.flush()  # nothing deferred: sends nothing
        assert conn.call("exists", key="a") == {"calls": 4}
    finally:
        conn.close()
        server.close()


def test_close_sends_what_was_deferred() -> None:
    recorder = Recorder()
    server = RpcServer(recorder).start()
    conn = RpcConnection(server.address)
    try:
        conn.defer("release_leases", leases=[["a", 7]])
        conn.close()
        assert recorder.released.wait(timeout=10)
        assert recorder.calls == [("release_leases", {"leases": [["a", 7]]})]
    finally:
        server.close()

"""The worker's control port with a cluster secret: only a peer that proves it is served; a
refused peer is closed before any of its bytes is read as a message, and the frontend already
connected keeps its link (nothing replaced, no order run)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvcake import auth
from kvcake.auth import AuthError, ClusterSecret
from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.worker_link import connect_workers
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Hello,
    Ping,
    Pong,
    PrefillOrder,
    to_wire,
)
from kvcake.server.worker.worker import Worker
from kvcake.store.protocol import encode
from tests.server.worker.links import next_of

ENGINE = EngineConfig(kv_cache_bytes=4 * 2**20)
SECRET = ClusterSecret(b"the-right-cluster-secret-0123456789")
WRONG = ClusterSecret(b"a-wrong-cluster-secret-9876543210")


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    config = WorkerConfig(role=Role.COLOCATED, engine=ENGINE, worker_id="guarded",
                          secret=SECRET)
    with Worker(config) as w:
        yield w


@pytest.fixture()
def frontend(worker: Worker) -> Iterator[MessageLink]:
    link = MessageLink.connect(worker.address, secret=SECRET)
    try:
        assert next_of(link, Hello).worker_id == "guarded"
        yield link
    finally:
        link.close()


def _still_served(link: MessageLink, seq: int) -> None:
    """The frontend's link is the worker's link still: a ping is answered on it."""
    link.send(Ping(seq))
    assert next_of(link, Pong, Hello) == Pong(seq)


def test_the_right_secret_is_served(worker: Worker) -> None:
    [view] = connect_workers([worker.address], secret=SECRET)
    try:
        assert (view.hello.worker_id, view.hello.role) == ("guarded", "colocated")
    finally:
        view.link.close()


def test_a_wrong_secret_is_refused_and_touches_nothing(worker: Worker,
                                                       frontend: MessageLink) -> None:
    with pytest.raises(AuthError, match="refused this connection: wrong cluster secret"):
        MessageLink.connect(worker.address, secret=WRONG)
    _still_served(frontend, 1)
    assert worker.engine is not None and not worker.engine.has_unfinished()


def test_no_secret_is_told_and_its_order_is_never_read(
        worker: Worker, frontend: MessageLink, caplog: pytest.LogCaptureFixture) -> None:
    # A peer without the secret sends an order straight away: the worker reads only its
    # answer to the challenge, refuses it and closes; the order never reaches the engine.
    host, port = worker.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(encode(to_wire(PrefillOrder("intruder", [1, 2, 3], {"max_tokens": 2},
                                              [], {}, []))))
        received = b""
        try:
            while chunk := s.recv(4096):
                received += chunk
        except ConnectionResetError:  # closed with the order unread in its buffer
            pass
    assert auth.HELLO_MAGIC.startswith(received[:len(auth.HELLO_MAGIC)])  # only a challenge
    assert "refused a kvcake/worker/1 connection" in caplog.text
    _still_served(frontend, 2)
    assert worker.engine is not None and not worker.engine.has_unfinished()
    with pytest.raises(ValueError, match="may ask for a cluster secret"):
        connect_workers([worker.address])
    _still_served(frontend, 3)


def test_a_silent_peer_does_not_hold_up_the_frontend(worker: Worker) -> None:
    # A connection that never answers the challenge waits on its own thread.
    host, port = worker.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10):
        link = MessageLink.connect(worker.address, secret=SECRET)
        try:
            assert next_of(link, Hello).worker_id == "guarded"
        finally:
            link.close()

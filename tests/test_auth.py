"""The cluster secret and its HMAC challenge-response, over socket pairs (no ports)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcake import auth
from kvcake.auth import AuthError, ClusterSecret

SECRET = ClusterSecret.from_text("s" * 32)
OTHER = ClusterSecret.from_text("t" * 32)


class _Peer:
    """The other end of a socket pair, running `side` on a thread; `result()` joins it and
    returns what `side` returned (or raised)."""

    def __init__(self, side: Callable[[socket.socket], object]) -> None:
        self.sock, self._other = socket.socketpair()
        self._side = side
        self._out: list[object] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out.append(self._side(self._other))
        except Exception as exc:  # handed to the test
            self._out.append(exc)
        finally:
            self._other.close()

    def result(self) -> object:
        self._thread.join(5.0)
        assert not self._thread.is_alive()
        self.sock.close()
        return self._out[0]


def _serve(secret: ClusterSecret, context: bytes = auth.STORE_RPC) -> Callable[[socket.socket], object]:
    def run(sock: socket.socket) -> object:
        auth.serve_handshake(sock, secret, context, timeout_s=5.0)
        return sock.recv(5)  # the protocol's first bytes come after the handshake

    return run


def test_the_right_secret_is_admitted_and_the_stream_goes_on() -> None:
    peer = _Peer(_serve(SECRET))
    auth.authenticate(peer.sock, ClusterSecret.from_text("s" * 32), auth.STORE_RPC, timeout_s=5.0)
    peer.sock.sendall(b"hello")
    assert peer.result() == b"hello"


def test_a_wrong_secret_is_refused_on_both_sides() -> None:
    peer = _Peer(_serve(SECRET))
    with pytest.raises(AuthError, match="refused this connection: wrong cluster secret"):
        auth.authenticate(peer.sock, OTHER, auth.STORE_RPC, timeout_s=5.0)
    result = peer.result()
    assert isinstance(result, AuthError) and "does not prove the cluster secret" in str(result)


def test_an_answer_for_another_protocol_is_no_answer() -> None:
    peer = _Peer(_serve(SECRET, auth.SEGMENT))
    with pytest.raises(AuthError):
        auth.authenticate(peer.sock, SECRET, auth.STORE_RPC, timeout_s=5.0)
    assert isinstance(peer.result(), AuthError)


def test_a_client_without_a_secret_is_refused_and_reads_a_hello() -> None:
    peer = _Peer(_serve(SECRET))
    peer.sock.sendall(b"\x00" * auth.ANSWER_BYTES)  # a protocol frame where the answer should be
    hello = peer.sock.recv(auth.HELLO_BYTES)
    result = peer.result()
    assert isinstance(result, AuthError) and "did not answer" in str(result)
    assert auth.is_hello(hello) and auth.is_hello(hello[:4]) and not auth.is_hello(b"KVC")


def test_a_server_without_the_secret_is_not_trusted() -> None:
    """Mutual: a server that accepts anything but cannot prove the secret is refused."""
    def impostor(sock: socket.socket) -> None:
        sock.sendall(auth.HELLO_MAGIC + os.urandom(auth.NONCE_BYTES))
        sock.recv(auth.ANSWER_BYTES)
        sock.sendall(b"\x00" + os.urandom(auth.MAC_BYTES))

    peer = _Peer(impostor)
    with pytest.raises(AuthError, match="does not hold the cluster secret"):
        auth.authenticate(peer.sock, SECRET, auth.WORKER, timeout_s=5.0)
    peer.result()


def test_a_server_without_auth_is_named_as_such() -> None:
    peer = _Peer(lambda s: s.sendall(b"\x00" * auth.HELLO_BYTES))
    with pytest.raises(AuthError, match="sent no cluster-secret challenge"):
        auth.authenticate(peer.sock, SECRET, auth.WORKER, timeout_s=5.0)
    peer.result()


def test_admit_logs_a_refusal_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.auth")
    with caplog.at_level(logging.WARNING, "test.auth"):
        peer = _Peer(lambda s: auth.admit(s, SECRET, auth.SEGMENT, log, timeout_s=5.0))
        with pytest.raises(AuthError):
            auth.authenticate(peer.sock, OTHER, auth.SEGMENT, timeout_s=5.0)
        assert peer.result() is False
    assert "refused a kvcake/segment/1 connection" in caplog.text
    a, b = socket.socketpair()
    assert auth.admit(a, None, auth.SEGMENT, log) is True  # no secret: open, nothing exchanged
    auth.authenticate(b, None, auth.SEGMENT)
    a.close()
    b.close()


def test_loading_a_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret"
    generated = ClusterSecret.generate()
    generated.write(path)
    assert ClusterSecret.from_file(path) == generated != ClusterSecret.generate()
    assert ClusterSecret.load(file=str(path)) == generated and ClusterSecret.load() is None
    assert "hidden" in repr(generated) and generated.text() not in repr(generated)
    monkeypatch.setenv("MY_SECRET", generated.text())
    assert ClusterSecret.load(env="MY_SECRET") == generated
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        ClusterSecret.from_file(path)
    with pytest.raises(ValueError, match="not both"):
        ClusterSecret.load(file=str(path), env="MY_SECRET")
    with pytest.raises(ValueError, match="NO_SUCH_VAR is not set"):
        ClusterSecret.from_env("NO_SUCH_VAR")
    with pytest.raises(ValueError, match="at least 16"):
        ClusterSecret.from_text("short")
    with pytest.raises(ValueError, match="No such file"):
        ClusterSecret.from_file(tmp_path / "missing")

"""A decode step's tokens leave as one write: `MessageLink.send_many` (frames back to back, read
one by one) and `DecodeRole.step` (one `send_many` per step, every live request's Tokens)."""

from __future__ import annotations

import socket
from typing import Any

from kvcake.engine.engine import RequestOutput
from kvcake.engine.sequence import FinishReason
from kvcake.server.worker.decode import DecodeRole
from kvcake.server.worker.messages import LoadReport, Message, MessageLink, Tokens


class _CountingSocket:
    """A socket whose sendall calls are counted (socket objects take no new attributes)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sendalls = sock, 0

    def sendall(self, data: bytes) -> None:
        self.sendalls += 1
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_send_many_is_one_write_read_back_in_order() -> None:
    a, b = socket.socketpair()
    sender, receiver = MessageLink(a), MessageLink(b)
    counting = _CountingSocket(a)
    sender._sock = counting  # type: ignore[assignment]
    batch: list[Message] = [Tokens("r1", [5], None), Tokens("r2", [6, 7], None),
                            Tokens("r3", [], "length"), LoadReport(0, 2, 9)]
    sender.send_many(batch)
    sender.send_many([])  # nothing to send: no write
    assert counting.sendalls == 1
    assert [receiver.recv() for _ in batch] == batch
    sender.close()
    receiver.close()


class _Host:
    def __init__(self) -> None:
        self.writes: list[list[Message]] = []

    def send(self, message: Message) -> None:
        self.writes.append([message])

    def send_many(self, messages: list[Message]) -> None:
        self.writes.append(list(messages))


class _Engine:
    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    def step(self) -> list[RequestOutput]:
        return self.outputs


def _out(rid: str, token: int, reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(rid, [token], reason is not None, reason, 10, 0, 0.0, 0.0)


def test_decode_step_sends_its_tokens_in_one_write() -> None:
    role = DecodeRole.__new__(DecodeRole)  # only what step() reads: engine, worker, _live
    host = _Host()
    role.worker = host  # type: ignore[assignment]
    role._live = {"r1", "r2", "r3"}
    role.engine = _Engine([_out("r1", 5), _out("gone", 9), _out("r2", 6, FinishReason.LENGTH),
                           _out("r3", 7)])  # type: ignore[assignment]
    role.step()
    assert host.writes == [[Tokens("r1", [5], None), Tokens("r2", [6], "length"),
                            Tokens("r3", [7], None)]]
    assert role._live == {"r1", "r3"}  # the finished one is no longer live

"""A decode step's tokens leave as one write: `MessageLink.send_many` (frames back to back, read
one by one) and `DecodeRole.step` (one `send_many` per step, every live request's Tokens); with
`$KVCAKE_STEP_TRACE` the step is timed into a `StepTrace` line."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from kvcake.engine.engine import RequestOutput
from kvcake.engine.sequence import FinishReason
from kvcake.engine.step_trace import ENV, StepTrace
from kvcake.server.worker.decode import DecodeRole
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import LoadReport, Message, Tokens


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


class _Seq:
    def __init__(self, request_id: str, num_tokens: int) -> None:
        self.request_id, self.num_tokens = request_id, num_tokens


class _Batcher:
    def __init__(self, running: list[_Seq]) -> None:
        self.running = running


class _Engine:
    def __init__(self, outputs: list[RequestOutput], running: list[_Seq] | None = None) -> None:
        self.outputs = outputs
        self.batcher = _Batcher(running or [])

    def step(self) -> list[RequestOutput]:
        return self.outputs


def _out(rid: str, token: int, reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(rid, [token], reason is not None, reason, 10, 0, 0.0, 0.0)


def test_decode_step_sends_its_tokens_in_one_write() -> None:
    role = DecodeRole.__new__(DecodeRole)  # only what step() reads: engine, worker, _live
    role._trace = None
    host = _Host()
    role.worker = host  # type: ignore[assignment]
    role._live = {"r1", "r2", "r3"}
    role.engine = _Engine([_out("r1", 5), _out("gone", 9), _out("r2", 6, FinishReason.LENGTH),
                           _out("r3", 7)])  # type: ignore[assignment]
    role.step()
    assert host.writes == [[Tokens("r1", [5], None), Tokens("r2", [6], "length"),
                            Tokens("r3", [7], None)]]
    assert role._live == {"r1", "r3"}  # the finished one is no longer live


class _Ticks:
    """A clock that moves by hand: each read returns the next value."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


def test_a_traced_step_writes_its_times_and_rows() -> None:
    out = io.StringIO()
    role = DecodeRole.__new__(DecodeRole)
    role._trace = StepTrace(out, clock=_Ticks(10.0, 10.02, 10.021), cpu=_Ticks(1.0, 1.015))
    role.worker = _Host()  # type: ignore[assignment]
    role._live = {"r1", "r2"}
    role.engine = _Engine([_out("r1", 5), _out("r2", 6)],  # type: ignore[assignment]
                          [_Seq("r1", 300), _Seq("r2", 1200)])
    role.step()
    line = json.loads(out.getvalue())
    assert line == {"t0": 10.0, "t1": 10.02, "t2": 10.021, "cpu": pytest.approx(0.015),
                    "rows": [["r1", 300], ["r2", 1200]]}


def test_the_trace_is_off_unless_the_environment_names_a_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert StepTrace.from_env("decode-1") is None
    monkeypatch.setenv(ENV, str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="not a directory"):
        StepTrace.from_env("decode-1")
    monkeypatch.setenv(ENV, str(tmp_path))
    trace = StepTrace.from_env("decode-1")
    assert trace is not None
    trace.record(1.0, 2.0, 2.5, 0.9, [("r", 7)])
    trace.close()
    [path] = tmp_path.glob("steps-decode-1-*.jsonl")
    assert json.loads(path.read_text())["rows"] == [["r", 7]]

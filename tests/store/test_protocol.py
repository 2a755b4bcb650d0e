"""Malformed control frames get a clear error reply, and the master keeps serving."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import pytest

from kvcake.store.config import NodeConfig
from kvcake.store.errors import InvalidRequest, MasterUnavailable, NoNodes, ObjectNotFound
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.store.protocol import (
    FrameReader,
    RpcConnection,
    encode,
    parse_address,
    read_frame,
    validate,
)
from kvcake.store.remote import RemoteMaster
from tests.net import refused_address


def _raw(server: MasterServer, payload: bytes) -> object:
    host, port = parse_address(server.address)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(payload)
        return read_frame(sock)


def _frame(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(("payload", "message"), [
    (_frame([1, 2, 3]), "must be a msgpack map"),
    (_frame({"id": 1, "op": "explode", "args": {}}), "unknown operation 'explode'"),
    (_frame({"id": 1, "op": "get", "args": {}}), "key: required by op 'get'"),
    (_frame({"id": 1, "op": "get", "args": {"key": 5}}), "key: must be str"),
    (_frame({"id": 1, "op": "get", "args": {"key": "a", "x": 1}}), "unknown fields"),
    (_frame({"id": "one", "op": "get"}), "integer id"),
    (struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", "not valid msgpack"),
    (struct.pack(">I", 1 << 30), "over the"),
])
def test_malformed_frames_get_error_replies(master: MasterServer, payload: bytes,
                                            message: str) -> None:
    reply = _raw(master, payload)
    assert isinstance(reply, dict) and reply["ok"] is False
    assert message in reply["error"]["message"]
    # ... and the master still answers a well-formed request on a new connection.
    remote = RemoteMaster(master.address)
    assert remote.exists("anything") is False
    remote.close()


def test_wire_errors_keep_their_types(master: MasterServer) -> None:
    remote = RemoteMaster(master.address)
    with pytest.raises(ObjectNotFound):
        remote.get("missing")
    with pytest.raises(KeyError):
        remote.remove("missing")
    with pytest.raises(NoNodes, match="kvcake store node"):
        remote.put_start("k", 10, 0)
    with pytest.raises(InvalidRequest, match="node operation"):
        RpcConnection(master.address).call("drop_disk", key="k", disk_version=1)
    assert remote.stats()["num_nodes"] == 0
    remote.close()


def test_master_down_is_a_clear_error() -> None:
    with refused_address() as dead, pytest.raises(MasterUnavailable, match=dead):
        RemoteMaster(dead)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("nohost")


def test_a_node_whose_master_is_down_leaves_nothing_running() -> None:
    """Its control server was started before the master was dialled, and used to keep
    serving (a thread and a listening port per failed start) after start() raised."""
    before = set(threading.enumerate())
    with refused_address() as dead:
        node = StoreNode(NodeConfig(dram_bytes=1 << 20, prefault=False), dead)
        with pytest.raises(MasterUnavailable, match="cannot connect"):
            node.start()
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    with pytest.raises(KeyError):
        node.engine.segment(f"store-{node.node_id}")  # its DRAM segment is released too


def test_master_stopping_mid_session_is_a_clear_error(master: MasterServer) -> None:
    remote = RemoteMaster(master.address)
    assert remote.exists("a") is False
    master.close()
    with pytest.raises(MasterUnavailable):
        remote.exists("a")
    remote.close()


def test_validate_accepts_a_good_request() -> None:
    assert validate({"id": 3, "op": "get", "args": {"key": "k"}}) == (3, "get", {"key": "k"})
    assert encode({"a": 1})[:4] == struct.pack(">I", len(msgpack.packb({"a": 1})))


def test_frames_sent_together_are_read_one_by_one(master: MasterServer) -> None:
    host, port = parse_address(master.address)
    with socket.create_connection((host, port), timeout=5) as sock:
        # A one-way release (never answered) and two requests arrive in one segment.
        sock.sendall(encode({"id": 1, "op": "release_leases", "args": {"leases": [["k", 9]]}})
                     + encode({"id": 2, "op": "exists", "args": {"key": "k"}})
                     + encode({"id": 3, "op": "release_leases", "args": {"leases": [7]}})
                     + encode({"id": 4, "op": "stats", "args": {}}))
        reader = FrameReader(sock)
        first, second = reader.read(), reader.read()
    assert isinstance(first, dict) and (first["id"], first["result"]) == (2, False)
    assert isinstance(second, dict) and second["id"] == 4 and second["ok"] is True


def test_a_put_without_a_checksum_needs_one_at_commit(master: MasterServer) -> None:
    remote = RemoteMaster(master.address)
    with pytest.raises(ValueError, match="use call"):
        RpcConnection(master.address).send("exists", key="k")
    master.service.register_node("n", 1 << 20, 0, {"segment": {}})
    assert remote.put_start("a", 10, None)[0]["node_id"] == "n"
    with pytest.raises(InvalidRequest, match="checksum"):
        remote.put_commit("a")
    remote.put_commit("a", 1234)
    assert remote.get("a")["checksum"] == 1234
    remote.close()


class _ScriptedSocket:
    """Each recv returns the next scripted chunk (cut to the size asked), as TCP may split or
    join frames; recv_into likewise."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)

    def recv(self, size: int) -> bytes:
        if not self._chunks:
            return b""
        chunk = self._chunks.pop(0)
        if len(chunk) > size:
            self._chunks.insert(0, chunk[size:])
        return chunk[:size]

    def recv_into(self, dest: memoryview) -> int:
        chunk = self.recv(len(dest))
        dest[:len(chunk)] = chunk
        return len(chunk)


def test_frame_reader_whole_split_and_joined_frames() -> None:
    frames = [encode({"id": i, "ok": True, "result": "x" * i}) for i in range(1, 6)]
    one, two, three, four, five = frames
    chunks = [one,  # exactly one frame (decoded without buffering)
              two + three[:3],  # a frame and the start of the next one's length prefix
              three[3:],
              four[:2], four[2:] + five,  # a split prefix, then two frames' worth at once
              encode({"id": 6, "ok": True, "result": None}) + b"payload",  # a frame, then bytes
              encode({"id": 7, "ok": True, "result": None})]
    reader = FrameReader(_ScriptedSocket(chunks))  # type: ignore[arg-type]
    got = [reader.read() for _ in range(6)]
    assert [m["id"] for m in got if isinstance(m, dict)] == [1, 2, 3, 4, 5, 6]
    assert [m["result"] for m in got[:5] if isinstance(m, dict)] == ["x" * i for i in range(1, 6)]
    dest = bytearray(7)
    reader.read_exact_into(memoryview(dest))
    assert dest == b"payload"
    last = reader.read()
    assert isinstance(last, dict) and last["id"] == 7
    assert reader.read() is None


def test_frame_reader_refuses_a_whole_frame_that_is_not_msgpack() -> None:
    bad = struct.pack(">I", 1) + b"\xc1"  # 0xc1: never used by msgpack
    reader = FrameReader(_ScriptedSocket([bad]))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="not valid msgpack"):
        reader.read()


def test_frame_reader_payload_straddling_recvs_then_frames_from_the_same_chunk() -> None:
    # A put_inline's shape: frame | payload, the payload's start in the frame's recv chunk
    # (kept as a view of it, copied once into its destination), its end in the next recv,
    # which also brings two whole frames and half of a third.
    head = encode({"id": 1, "op": "put_inline", "args": {"size_bytes": 10}})
    after = encode({"id": 2, "ok": True, "result": None}) + encode({"id": 3, "ok": True,
                                                                     "result": "y"})
    last = encode({"id": 4, "ok": True, "result": "z" * 40})
    reader = FrameReader(_ScriptedSocket([head + b"0123", b"456789" + after + last[:9],  # type: ignore[arg-type]
                                          last[9:]]))
    first = reader.read()
    assert isinstance(first, dict) and first["id"] == 1
    dest = bytearray(10)
    reader.read_exact_into(memoryview(dest))
    assert dest == b"0123456789"
    got = [reader.read() for _ in range(3)]
    assert [m["id"] for m in got if isinstance(m, dict)] == [2, 3, 4]
    assert isinstance(got[2], dict) and got[2]["result"] == "z" * 40
    assert reader.read() is None

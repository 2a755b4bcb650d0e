"""Hostile bytes at the store master's RPC port: random and truncated frames, huge lengths,
bodies that are not requests (the protocol's "wrong version": non-maps, bad ids, unknown ops or
fields, wrong types), and valid requests out of order (a commit with no put in progress, a
second put of a stored key, node operations sent to the master, ...). Each gets error replies or
a closed connection; the master keeps serving a member connected throughout; no object, no
replica and no byte of the node's segment changes.

Valid requests that are meant to change the store (a put, a remove, registering a node) are not
hostile input and are not generated: with a cluster secret (tests/store/test_auth.py) a stranger
cannot send them at all.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import MasterConfig, NodeConfig
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.store.protocol import MAX_FRAME_BYTES, SCHEMA, FrameReader, encode, parse_address
from kvcake.transfer import TransferConfig

FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = [f"obj-{i}" for i in range(4)]


class Served:
    """A TCP master, one node, four stored objects, and a member client connected to both."""

    def __init__(self) -> None:
        service = MasterService(MasterConfig(heartbeat_timeout_s=1e9, lease_s=1e9),
                                ManualClock(0.0))
        self.master = MasterServer(service, "127.0.0.1", 0, tick_interval_s=None).start()
        self.node = StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600),
                              self.master.address, node_id="n0").start()
        self.member = StoreClient(self.master.address, transfer_config=TransferConfig(
            serve=False, use_shared_memory=False, num_rails=1, io_timeout_s=5.0))
        self.values = {key: bytes([i]) * (1000 + 100 * i) for i, key in enumerate(KEYS)}
        for key, value in self.values.items():
            self.member.put(key, value)
        # A put's seal is one-way: an answered request on the same connection orders after it.
        assert self.member.exists(KEYS[-1])
        self.before = self.state()

    def state(self) -> tuple[Any, ...]:
        index = self.master.service.index
        objects = {k: (m.size_bytes, m.checksum, m.committed, m.pinned,
                       [(r.node_id, r.tier, r.offset, r.alloc_bytes, r.version, r.complete)
                        for r in m.replicas]) for k, m in index.objects.items()}
        return objects, sorted(index.nodes), bytes(self.node._view())

    def still_serves(self) -> None:
        assert self.member.get(KEYS[1]) == self.values[KEYS[1]]

    def close(self) -> None:
        self.member.close()
        self.node.close()
        self.master.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def exchange(address: str, data: bytes) -> list[Any]:
    """Send `data` on a new connection, close our sending side, and read every reply until the
    server closes the connection."""
    replies = []
    with socket.create_connection(parse_address(address), timeout=5.0) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed first
            return replies
        reader = FrameReader(sock)
        try:
            while (reply := reader.read()) is not None:
                replies.append(reply)
        except ConnectionResetError:  # closed with our bytes unread: same as a close
            pass
    return replies


def is_error(reply: Any) -> bool:
    return (isinstance(reply, dict) and reply.get("ok") is False
            and isinstance(reply.get("error"), dict) and "message" in reply["error"])


def check(served: Served, replies: list[Any], answered_ok: frozenset[str] = frozenset()) -> None:
    """Every reply an error (but the harmless queries in `answered_ok`); the master serves on;
    nothing stored changed."""
    for reply in replies:
        assert is_error(reply) or reply.get("op_ok") in answered_ok, reply
    served.still_serves()
    assert served.state() == served.before


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes(served: Served, data: bytes) -> None:
    check(served, exchange(served.master.address, data))


@FUZZ
@given(length=st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1), tail=st.binary(max_size=64))
def test_huge_lengths(served: Served, length: int, tail: bytes) -> None:
    replies = exchange(served.master.address, struct.pack(">I", length) + tail)
    assert all(is_error(r) and "over the" in r["error"]["message"] for r in replies)
    check(served, replies)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                               max_size=4),
    max_leaves=12)
not_requests = st.one_of(
    msgpack_values,  # anything: a map is checked like a request, the rest is refused
    st.fixed_dictionaries({"id": msgpack_values, "op": st.sampled_from(sorted(SCHEMA)),
                           "args": msgpack_values}),
    st.fixed_dictionaries({"id": st.integers(0, 100), "op": st.sampled_from(sorted(SCHEMA)),
                           "args": st.dictionaries(st.sampled_from(["zz", "nope"]),
                                                   msgpack_values, min_size=1)}),
    st.fixed_dictionaries({"id": st.integers(0, 100), "op": st.text(max_size=12).filter(
        lambda op: op not in SCHEMA), "args": st.just({})}),
)


def _body(value: Any) -> bytes:
    body = msgpack.packb(value, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _harmless(value: Any) -> bool:
    """A body that happens to be a valid request is dropped, unless it only reads (the
    generators above make that rare: unknown fields, unknown ops, random types)."""
    from kvcake.store.protocol import validate

    try:
        _, op, args = validate(value)
    except Exception:
        return True
    return op in ("exists", "stats", "exists_batch", "get", "get_batch", "heartbeat") and \
        "node_id" not in args


@FUZZ
@given(bodies=st.lists(not_requests.filter(_harmless), min_size=1, max_size=4),
       cut=st.integers(0, 400), truncate=st.booleans())
def test_bodies_that_are_not_requests_and_truncated_frames(
        served: Served, bodies: list[Any], cut: int, truncate: bool) -> None:
    data = b"".join(_body(b) for b in bodies)
    if truncate:
        data = data[:min(cut, len(data) - 1)]
    replies = exchange(served.master.address, data)
    assert all(isinstance(r, dict) and "ok" in r for r in replies)
    for reply in replies:  # the odd valid read-only request is answered; the rest are errors
        if not is_error(reply):
            reply["op_ok"] = "read"
    check(served, replies, frozenset({"read"}))


def _request(op: str, **args: Any) -> dict[str, Any]:
    return {"id": 5, "op": op, "args": args}


keys = st.sampled_from(KEYS) | st.text(min_size=1, max_size=8)
versions = st.lists(st.integers(0, 2**40), max_size=3)
OUT_OF_ORDER = st.one_of(
    st.builds(lambda k: _request("put_commit", key=k), keys),  # no put in progress
    st.builds(lambda k, c: _request("put_commit", key=k, checksum=c), keys, st.integers(0, 99)),
    st.builds(lambda k: _request("put_revoke", key=k), keys),
    st.builds(lambda k: _request("put_start", key=k, size_bytes=10, checksum=1),
              st.sampled_from(KEYS)),  # already stored
    st.builds(lambda ks: _request("put_commit_batch", keys=ks), st.lists(keys, max_size=3)),
    st.builds(lambda k, v, ok: _request("replicas_done", key=k, versions=v, ok=ok), keys,
              versions, st.booleans()),  # replicas nobody asked for
    st.builds(lambda op, k, v: _request(op, key=k, offset=0, alloc_bytes=64, version=v,
                                        disk_version=v),
              st.sampled_from(["demote", "promote"]), keys, st.integers(0, 99)),  # node ops
    st.builds(lambda k: _request("drop_disk", key=k, disk_version=1), keys),
    st.builds(lambda k: _request("get", key=k), st.text(min_size=1, max_size=8).filter(
        lambda k: k not in KEYS)),
    st.builds(lambda n: _request("unregister_node", node_id=n), st.text(max_size=6).filter(
        lambda n: n != "n0")),  # a node never registered
    st.builds(lambda k: _request("release_leases", leases=[[k, 12345]]), keys),
)
QUERIES = {"unregister_node", "put_commit_batch", "release_leases",
           "replicas_done"}  # answered ok (ignored), change nothing


@FUZZ
@given(requests=st.lists(OUT_OF_ORDER, min_size=1, max_size=5))
def test_valid_requests_out_of_order(served: Served, requests: list[dict[str, Any]]) -> None:
    replies = exchange(served.master.address, b"".join(encode(r) for r in requests))
    expected = [r for r in requests if r["op"] != "release_leases"]  # one-way: never answered
    assert len(replies) == len(expected)
    for request, reply in zip(expected, replies, strict=True):
        if request["op"] in QUERIES and not is_error(reply):
            if request["op"] == "put_commit_batch":  # one error per key inside
                assert all(item.get("ok") is False for item in reply["result"])
            reply["op_ok"] = "query"
    check(served, replies, frozenset({"query"}))


def test_the_checks_can_fail(served: Served) -> None:
    """A valid remove is seen as a change (and is then undone)."""
    replies = exchange(served.master.address, encode(_request("remove", key=KEYS[0])))
    assert replies and not is_error(replies[0])
    assert served.state() != served.before
    served.member.put(KEYS[0], served.values[KEYS[0]])
    served.before = served.state()
    served.still_serves()

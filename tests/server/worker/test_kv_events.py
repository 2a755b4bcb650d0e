"""KV events in vLLM's format: a plain ZMQ SUB socket receives `[topic, seq, payload]` and the
payload decodes with plain msgpack into vLLM's `KVEventBatch` ([ts, events], each event a map
tagged by "type" with vLLM's field names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pytest

from kvcake.hashing import block_keys
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.worker.kv_event_publisher import KvEventPublisher, decode_batch
from tests.server.test_disagg import cluster_config, run

zmq = pytest.importorskip("zmq")

STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                 "lora_id", "medium", "lora_name"}


@pytest.fixture
def sub() -> Iterator[object]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
    yield sock
    sock.close()
    ctx.term()


def _receive(sock: object, publish: Callable[[int], None], tries: int = 50) -> list[bytes]:
    """Publish (attempt i) until the subscription has joined and one message arrives (a PUB
    drops what it sends before a subscriber's subscription reaches it)."""
    for i in range(tries):
        publish(i)
        if sock.poll(200):  # type: ignore[attr-defined]
            return list(sock.recv_multipart())  # type: ignore[attr-defined]
    raise AssertionError("no KV event batch arrived")


def test_a_plain_sub_socket_decodes_the_batches(sub: object) -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:*", "kv@w1@tiny", block_size=16, medium="CPU",
                           wall_s=lambda: 123.5)
    try:
        sub.connect(pub.endpoint)  # type: ignore[attr-defined]
        events = [(True, 11), (True, 12), (False, 7), (True, 13)]
        topic, seq, payload = _receive(sub, lambda i: pub.publish(events))
        assert topic == b"kv@w1@tiny"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == pub.seq - 1
        batch = msgpack.unpackb(payload)
        assert batch[0] == 123.5 and len(batch) == 2  # [ts, events]: no data-parallel rank
        stored, removed, again = batch[1]
        assert set(stored) == STORED_FIELDS
        assert (stored["type"], stored["block_hashes"], stored["block_size"]) == (
            "BlockStored", [11, 12], 16)
        assert stored["parent_block_hash"] is None and stored["medium"] == "CPU"
        assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
        assert again["block_hashes"] == [13] and again["parent_block_hash"] is None
        pub.publish(events)  # sequence numbers go up by one per batch
        assert int.from_bytes(sub.recv_multipart()[1], "big") == \
            int.from_bytes(seq, "big") + 1  # type: ignore[attr-defined]
        assert decode_batch(payload) == (123.5, [11, 12, 13], [7])
    finally:
        pub.close()


def test_vllm_older_array_events_and_byte_hashes_decode() -> None:
    old = msgpack.packb([1.0, [["BlockStored", [5, 6], None, [1, 2], 16, None],
                               ["BlockRemoved", [b"\x00" * 7 + b"\x09"]],
                               ["AllBlocksCleared"]], 0])
    assert decode_batch(old) == (1.0, [5, 6], [9])
    with pytest.raises(ValueError, match="not a KVEventBatch payload"):
        decode_batch(b"\x01\x02")


def test_a_prefill_worker_publishes_the_prompt_blocks(sub: object,
                                                      tmp_path_factory: pytest.TempPathFactory
                                                      ) -> None:
    base = cluster_config(tmp_path_factory, 1, 1)
    workers = tuple(dataclasses.replace(w, kv_events_endpoint="tcp://127.0.0.1:*")
                    for w in base.workers)
    with Cluster(dataclasses.replace(base, workers=workers), in_process=True) as cluster:
        prefill = next(w for w in cluster.workers.values() if w.config.role.value == "prefill")
        assert prefill.kv_events is not None and prefill.engine is not None
        sub.connect(prefill.kv_events.endpoint)  # type: ignore[attr-defined]
        prompts: list[list[int]] = []

        def request(i: int) -> None:
            prompts.append(np.random.default_rng(100 + i).integers(0, 256, 40).tolist())
            assert cluster.backend is not None
            run(cluster.backend, prompts[-1], 2)

        topic, _seq, _payload = _receive(sub, request, tries=10)  # subscribed from here on
        assert topic.startswith(b"kv@" + prefill.worker_id.encode() + b"@")
        request(99)  # published entirely after the subscription joined
        engine = prefill.engine
        keys = [int(k) for k in block_keys(prompts[-1], engine.block_size, engine.namespace)]
        stored: set[int] = set()
        while not set(keys) <= stored and sub.poll(5000):  # type: ignore[attr-defined]
            stored |= set(decode_batch(sub.recv_multipart()[2])[1])  # type: ignore[attr-defined]
        assert keys and set(keys) <= stored  # every full block of the prompt

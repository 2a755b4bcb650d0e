"""A worker's prefix-cache events in vLLM's `KVEventBatch` format, on a ZMQ PUB socket.

So that the KV-aware routers that read vLLM's events (llm-d's indexer, Dynamo's) can read ours.
The wire, as vLLM's `ZmqEventPublisher` sends it (vllm/distributed/kv_events.py):

- one multipart message per batch: `[topic, seq, payload]`; `seq` is 8 bytes big-endian, +1 per
  batch from 0; `topic` is `kv@<worker id>@<model>` (llm-d's scheme; subscribe to a prefix);
- `payload`: msgpack of the batch as an array `[ts, events]` (`ts`: wall seconds; vLLM's optional
  third element, the data-parallel rank, is left out as its encoder omits a default);
- each event a map tagged by `"type"`: `{"type": "BlockStored", "block_hashes": [...],
  "parent_block_hash": ..., "token_ids": [...], "block_size": n, "lora_id": null,
  "medium": ..., "lora_name": null}` or `{"type": "BlockRemoved", "block_hashes": [...],
  "medium": ...}`; consecutive stores (removals) of one engine step go in one event.

Block hashes are our chained block keys (integers, `kvcake/hashing.py`); the engine's events do
not carry token ids, so `token_ids` is empty and `parent_block_hash` is the key before a run
when the run continues one stored earlier in the same batch, else null. `medium` is "CPU" or
"GPU" (where the pool lives). `decode_batch` reads such a payload back (the frontend's side).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = ["KvEventPublisher", "KvEventRun", "decode_batch", "encode_batch", "runs"]


@dataclass(frozen=True)
class KvEventRun:
    """Consecutive blocks stored (or removed) in one engine step."""

    stored: bool
    keys: tuple[int, ...]


def runs(events: Iterable[tuple[bool, int]]) -> list[KvEventRun]:
    """(stored?, key) events in order -> runs of the same kind."""
    out: list[KvEventRun] = []
    for stored, key in events:
        if out and out[-1].stored == stored:
            out[-1] = KvEventRun(stored, (*out[-1].keys, key))
        else:
            out.append(KvEventRun(stored, (key,)))
    return out


def encode_batch(batch: Sequence[KvEventRun], block_size: int, medium: str,
                 ts: float) -> bytes:
    events: list[dict[str, Any]] = []
    last_stored: int | None = None
    for run in batch:
        if run.stored:
            events.append({"type": "BlockStored", "block_hashes": list(run.keys),
                           "parent_block_hash": last_stored, "token_ids": [],
                           "block_size": block_size, "lora_id": None, "medium": medium,
                           "lora_name": None})
            last_stored = run.keys[-1]
        else:
            events.append({"type": "BlockRemoved", "block_hashes": list(run.keys),
                           "medium": medium})
            last_stored = None
    return bytes(msgpack.packb([ts, events]))


def decode_batch(payload: bytes) -> tuple[float, list[int], list[int]]:
    """(ts, stored keys, removed keys) of a `KVEventBatch` payload (ours or vLLM's; events as
    tagged maps or as vLLM's older tagged arrays). ValueError on anything else."""
    try:
        batch = msgpack.unpackb(payload, strict_map_key=False)
        ts, events = float(batch[0]), batch[1]
        stored: list[int] = []
        removed: list[int] = []
        for event in events:
            if isinstance(event, dict):
                kind, hashes = event["type"], event.get("block_hashes", [])
            else:  # ["BlockStored", block_hashes, ...]
                kind, hashes = event[0], (event[1] if len(event) > 1 else [])
            if kind == "BlockStored":
                stored += [_key(h) for h in hashes]
            elif kind == "BlockRemoved":
                removed += [_key(h) for h in hashes]
            elif kind != "AllBlocksCleared":
                raise ValueError(f"unknown event type {kind!r}")
        return ts, stored, removed
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        raise ValueError(f"KV event batch: not a KVEventBatch payload ({exc})") from None


def _key(block_hash: int | bytes) -> int:
    if isinstance(block_hash, bytes):  # vLLM's sha256 hashes: the first 8 bytes, as ours
        return int(struct.unpack(">Q", block_hash[:8].rjust(8, b"\0"))[0])
    return int(block_hash)


class KvEventPublisher:
    """One PUB socket bound at `endpoint` (`tcp://HOST:PORT`, port `*` for any: see `endpoint`
    after start). Not thread-safe: the worker's engine-loop thread publishes."""

    def __init__(self, endpoint: str, topic: str, block_size: int, medium: str,
                 wall_s: Callable[[], float] = time.time) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events_endpoint: cannot bind {endpoint!r} ({exc}); use "
                             "tcp://HOST:PORT, or tcp://HOST:* for any port") from None
        self.endpoint = str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self.topic = topic.encode()
        self.block_size, self.medium, self._wall_s = block_size, medium, wall_s
        self.seq = 0

    def publish(self, events: Iterable[tuple[bool, int]]) -> None:
        batch = runs(events)
        if not batch:
            return
        payload = encode_batch(batch, self.block_size, self.medium, self._wall_s())
        self._pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.seq += 1

    def close(self) -> None:
        self._pub.close(linger=0)
        self._ctx.term()

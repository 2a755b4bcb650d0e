"""Raw payload bytes behind a control frame (protocol.py): which ops carry them, how many a
request says follow, and `Payload`, what the server hands such an op's handler to read them
straight into their destination (no msgpack copy of the bytes).

    request frame (op in PAYLOAD_OPS, args[PAYLOAD_OPS[op]] = N) | N raw bytes
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcake.store.errors import InvalidRequest

if TYPE_CHECKING:
    from kvcake.store.frames import FrameReader

# Ops whose frame is followed by raw payload bytes, and the argument that says how many: the
# server hands the handler a `Payload` to read them straight into their destination (no msgpack
# copy), and reads what the handler left so the stream stays in step.
PAYLOAD_OPS = {"put_inline": "size_bytes", "put_forward": "size_bytes"}
MAX_PAYLOAD_BYTES = 64 << 20


def payload_size(message: object) -> int | None:
    """How many raw bytes follow this request's frame: None for an op without a payload;
    InvalidRequest when a payload op's size is missing or out of range (the stream cannot be
    resynchronised then)."""
    if not isinstance(message, dict) or message.get("op") not in PAYLOAD_OPS:
        return None
    args = message.get("args")
    field = PAYLOAD_OPS[str(message["op"])]
    size = args.get(field) if isinstance(args, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_PAYLOAD_BYTES:
        raise InvalidRequest(f"{field}: a payload size from 0 to {MAX_PAYLOAD_BYTES} bytes is "
                             f"required by op {message['op']!r}, got {size!r}")
    return size


class Payload:
    """The raw bytes that follow one request's frame. `read_into(dest)` moves them (once, all of
    them) into `dest`; `skip()` discards what was not read."""

    def __init__(self, reader: FrameReader, size_bytes: int) -> None:
        self._reader = reader
        self.size_bytes = size_bytes
        self._done = False

    def read_into(self, dest: memoryview) -> None:
        """Fill `dest` (exactly `size_bytes` long) with the payload; OSError if the stream ends."""
        if self._done:
            raise InvalidRequest("payload: already read")
        if len(dest) != self.size_bytes:
            raise ValueError(f"dest: {len(dest)} bytes for a payload of {self.size_bytes}")
        self._done = True
        self._reader.read_exact_into(dest)

    def skip(self) -> None:
        if not self._done:
            self._done = True
            self._reader.skip(self.size_bytes)

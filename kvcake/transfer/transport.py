"""The one interface every transport implements: move one slice over one endpoint.

An endpoint is one connection (TCP) or one mapping (shared memory) to one peer, owned by one
rail's thread: a Transport is never used by two threads at once, so it needs no locks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.segment import SegmentDesc


class TransportKind(enum.Enum):
    TCP = "tcp"
    SHM = "shm"


@dataclass(frozen=True)
class EndpointKey:
    """Names an endpoint within one rail: the transport and the peer (address or shm name)."""

    kind: TransportKind
    peer: str


class Transport(Protocol):
    def read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
             checksum: ChecksumKind | None) -> int | None:
        """Fill all of `dest` from the segment at `offset`.

        With `checksum`, returns the digest the source computed over those bytes (the caller
        checks `dest` against it), else None. Raises TransportError; `dest` is then undefined.
        """
        ...

    def write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
              checksum: ChecksumKind | None, digest: int | None) -> None:
        """Store all of `src` into the segment at `offset`.

        With `checksum` and `digest` (of `src`, as the caller computed it), the destination checks
        the bytes it stored and the write fails (retryably) on a mismatch. Raises TransportError;
        the remote range is then undefined until a retry succeeds.
        """
        ...

    def close(self) -> None:
        """Release the connection or mapping. Idempotent."""
        ...


TransportWrapper = Callable[[Transport, EndpointKey, int], Transport]
"""Hook around every new endpoint: (transport, key, rail) -> transport. Tests wrap in faults."""

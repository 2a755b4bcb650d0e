"""The one interface every transport implements: move one slice over one endpoint.

An endpoint is one connection (TCP) or one mapping (shared memory) to one peer, owned by one
rail's thread: a Transport is never used by two threads at once, so it needs no locks. A transport
that can keep several slices in flight on one connection also implements `PipelinedTransport`;
the rails use that when its `pipelined` is true, and the plain one-slice calls otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.errors import TransportError
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


@dataclass(frozen=True)
class Completion:
    """The outcome of one pipelined operation, named by the token its `start_*` call returned.

    digest: for a read with a checksum, the digest the source computed (the caller checks the
      destination against it); else None.
    error: set when the peer rejected this one operation, or a read's bytes did not match their
      digest (the connection is still good and the other outstanding operations go on); None on
      success.
    verified: True when the transport itself already checked a read's bytes against `digest` as
      they arrived; the caller then need not digest them again. A wrapper that alters the bytes
      after that check must report False.
    """

    token: int
    digest: int | None = None
    error: TransportError | None = None
    verified: bool = False


@runtime_checkable
class PipelinedTransport(Transport, Protocol):
    """A transport that keeps several operations outstanding on one connection.

    `start_read` / `start_write` send a request (a write also sends its bytes) and return a token
    without waiting for the reply; `next_completion` blocks for the next reply, in whatever order
    the peer sends them, and matches it to its operation by id. A `TransportError` raised by any of
    the three means the connection is lost: every outstanding operation is lost with it (the
    transport is closed; the caller retries them elsewhere). A read's destination is undefined
    until its completion arrives. The synchronous `read` / `write` may only be used while no
    pipelined operation is outstanding.
    """

    @property
    def pipelined(self) -> bool:
        """True when the pipelined calls below may be used (a wrapper says what it wraps)."""
        ...

    @property
    def num_outstanding(self) -> int:
        """Operations started and not yet returned by `next_completion`."""
        ...

    def start_read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
                   checksum: ChecksumKind | None) -> int:
        ...

    def start_write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
                    checksum: ChecksumKind | None, digest: int | None) -> int:
        """As `write`, except that with `checksum` and no `digest` the transport digests `src`
        itself as it sends it (the bytes are the caller's, read once)."""
        ...

    def next_completion(self) -> Completion:
        """Block for the reply to any outstanding operation; RuntimeError when there is none."""
        ...


TransportWrapper = Callable[[Transport, EndpointKey, int], Transport]
"""Hook around every new endpoint: (transport, key, rail) -> transport. Tests wrap in faults."""

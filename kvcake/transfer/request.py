"""Transfer requests and their status: plain values shared by the engine and its callers."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NewType

from kvcake.transfer.errors import TransferError
from kvcake.transfer.segment import SegmentDesc

BatchId = NewType("BatchId", int)


class TransferOp(enum.Enum):
    READ = "read"  # remote segment -> local buffer
    WRITE = "write"  # local buffer -> remote segment


class RequestState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferRequest:
    """Move `length` bytes between `buffer` and `segment` at `remote_offset`.

    buffer: local memory (see `buffer_view`): the destination of a READ (must be writable), the
      source of a WRITE. Registered or not; use `TransferEngine.local_view` for a registered one.
    length: defaults to the whole buffer. The remote range [remote_offset, remote_offset + length)
      must lie inside the segment, and the buffer must hold at least `length` bytes.
    checksum_tcp: where this request crosses TCP, carry and verify a digest per slice (True) or
      not (False); None follows the engine's `checksum_tcp`. Over shared memory the engine's
      `checksum_shm` applies (see `TransferConfig.digests`).
    """

    op: TransferOp
    buffer: Any
    segment: SegmentDesc
    remote_offset: int = 0
    length: int | None = None
    checksum_tcp: bool | None = None


@dataclass(frozen=True)
class RequestStatus:
    state: RequestState
    bytes_done: int
    length: int
    error: str | None = None


@dataclass(frozen=True)
class BatchStatus:
    """A snapshot of one batch: one `RequestStatus` per request, in submission order."""

    batch_id: BatchId
    requests: tuple[RequestStatus, ...]

    @property
    def finished(self) -> bool:
        return all(r.state is not RequestState.PENDING for r in self.requests)

    @property
    def succeeded(self) -> bool:
        return all(r.state is RequestState.DONE for r in self.requests)

    @property
    def bytes_done(self) -> int:
        return sum(r.bytes_done for r in self.requests)

    def raise_for_failure(self) -> None:
        """Raise `TransferError` naming every failed request; do nothing if none failed."""
        failed = [f"request {i}: {r.error}" for i, r in enumerate(self.requests)
                  if r.state is RequestState.FAILED]
        if failed:
            raise TransferError(f"batch {self.batch_id}: " + "; ".join(failed))

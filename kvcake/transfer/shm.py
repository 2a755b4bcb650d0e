"""Shared-memory endpoint: a peer's segment on this host, mapped into this process.

The peer registered its segment as a named POSIX shared-memory block; we map /dev/shm/<name>
directly with mmap rather than through `SharedMemory(name=...)`, whose resource tracker would
unlink the peer's block when this process exits (Python < 3.13). A slice is one numpy copy,
which releases the GIL, so rails copy in parallel.

A mapping outlives its name: when the owner unregisters the segment or dies (its resource tracker
unlinks the block), our mapping would still show the old bytes. So every slice first checks that
the block is still linked (one fstat on the descriptor we keep open) and fails otherwise.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.errors import TransportError
from kvcake.transfer.segment import SHM_DIR, SegmentDesc


class ShmTransport:
    """A `Transport` over one mapping of one shared-memory segment. Create with `attach`."""

    def __init__(self, shm_name: str, fd: int, mapping: mmap.mmap) -> None:
        self.shm_name = shm_name
        self._fd = fd
        self._mapping: mmap.mmap | None = mapping
        self._array: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8)

    @classmethod
    def attach(cls, shm_name: str) -> ShmTransport:
        if "/" in shm_name or not shm_name:
            raise TransportError(f"bad shared-memory name {shm_name!r}", retryable=False)
        try:
            fd = os.open(os.path.join(SHM_DIR, shm_name), os.O_RDWR)
        except OSError as e:
            raise TransportError(f"cannot open shared memory {shm_name!r}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        except (OSError, ValueError) as e:
            os.close(fd)
            raise TransportError(f"cannot map shared memory {shm_name!r}: {e}") from e
        return cls(shm_name, fd, mapping)

    def read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
             checksum: ChecksumKind | None) -> int | None:
        source = self._region(segment, offset, len(dest))
        digest = checksum.compute(source.data) if checksum is not None else None
        np.copyto(np.frombuffer(dest, dtype=np.uint8), source)
        return digest

    def write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
              checksum: ChecksumKind | None, digest: int | None) -> None:
        target = self._region(segment, offset, len(src))
        np.copyto(target, np.frombuffer(src, dtype=np.uint8))
        if checksum is not None and digest is not None and checksum.compute(target.data) != digest:
            raise TransportError(f"shm {self.shm_name}: checksum mismatch on written data")

    def close(self) -> None:
        self._array = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # a slice view is still alive somewhere; the mapping goes with it
            self._mapping = None

    def _region(self, segment: SegmentDesc, offset: int, length: int) -> np.ndarray:
        if self._array is None:
            raise TransportError(f"shm {self.shm_name}: endpoint is closed")
        if os.fstat(self._fd).st_nlink == 0:
            raise TransportError(f"shm {self.shm_name}: segment {segment.name!r} was unlinked "
                                 f"(its owner unregistered it or exited)", retryable=False)
        if segment.length_bytes > len(self._array):
            raise TransportError(f"shm {self.shm_name} holds {len(self._array)} bytes, less than "
                                 f"segment {segment.name!r} ({segment.length_bytes})",
                                 retryable=False)
        if length == 0 or offset + length > segment.length_bytes:
            raise TransportError(f"range [{offset}, {offset + length}) outside segment "
                                 f"{segment.name!r} of {segment.length_bytes} bytes",
                                 retryable=False)
        return self._array[offset:offset + length]

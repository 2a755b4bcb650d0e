"""A transport wrapper that injects faults, seeded, for tests: delay, drop, corrupt, hold.

    engine = TransferEngine(config, wrap_transport=lambda t, key, rail:
                            FaultyTransport(t, FaultSpec(drop_rate=0.2, corrupt_rate=0.2), seed=rail))

drop: the slice fails as a lost connection would (a read first scribbles on its destination, as a
  half-delivered read does). corrupt: one byte flips in the bytes delivered (read) or sent (write)
  while the checksum still describes the true bytes, so only checksums stand between the caller
  and bad data. delay: the slice is held `delay_s`. hold: every slice waits until the event is set
  (lets a test pin a batch as pending without sleeping).

Around a pipelined transport the wrapper pipelines too, with the same faults per slice: a dropped
slice fails alone (its completion is an error) while the others stay in flight.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.errors import TransportError
from kvcake.transfer.segment import SegmentDesc
from kvcake.transfer.transport import Completion, PipelinedTransport, Transport


@dataclass(frozen=True)
class FaultSpec:
    drop_rate: float = 0.0
    corrupt_rate: float = 0.0
    delay_rate: float = 0.0
    delay_s: float = 0.0
    hold: threading.Event | None = None

    def __post_init__(self) -> None:
        for name in ("drop_rate", "corrupt_rate", "delay_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultSpec.{name} must be in [0, 1], got {value}")
        if self.delay_s < 0:
            raise ValueError(f"FaultSpec.delay_s must be >= 0, got {self.delay_s}")


class FaultyTransport:
    """Wraps any `Transport`; the same seed gives the same faults for the same slice sequence."""

    def __init__(self, inner: Transport, spec: FaultSpec, seed: int = 0) -> None:
        self.inner = inner
        self.spec = spec
        self._rng = random.Random(seed)
        self.num_dropped = 0
        self.num_corrupted = 0
        self._tokens = itertools.count(1)
        self._ready: deque[Completion] = deque()  # injected drops, answered first
        self._inner_tokens: dict[int, tuple[int, memoryview | None]] = {}  # inner -> ours, read dest

    def read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
             checksum: ChecksumKind | None) -> int | None:
        self._before()
        if self._roll(self.spec.drop_rate):
            dest[: min(len(dest), 64)] = self._rng.randbytes(min(len(dest), 64))
            self.num_dropped += 1
            raise TransportError("injected drop")
        digest = self.inner.read(segment, offset, dest, checksum=checksum)
        if self._roll(self.spec.corrupt_rate):
            self._flip(dest)
        return digest

    def write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
              checksum: ChecksumKind | None, digest: int | None) -> None:
        self._before()
        if self._roll(self.spec.drop_rate):
            self.num_dropped += 1
            raise TransportError("injected drop")
        if self._roll(self.spec.corrupt_rate):
            damaged = bytearray(src)
            self._flip(memoryview(damaged))
            src = memoryview(damaged)
        self.inner.write(segment, offset, src, checksum=checksum, digest=digest)

    # -- pipelined (only when the wrapped transport pipelines) ----------------------------------
    @property
    def pipelined(self) -> bool:
        return bool(getattr(self.inner, "pipelined", False))

    @property
    def num_outstanding(self) -> int:
        return len(self._ready) + len(self._inner_tokens)

    def start_read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
                   checksum: ChecksumKind | None) -> int:
        self._before()
        token = next(self._tokens)
        if self._roll(self.spec.drop_rate):
            dest[: min(len(dest), 64)] = self._rng.randbytes(min(len(dest), 64))
            self._drop(token)
        else:
            inner = cast(PipelinedTransport, self.inner)
            self._inner_tokens[inner.start_read(segment, offset, dest, checksum=checksum)] = \
                (token, dest)
        return token

    def start_write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
                    checksum: ChecksumKind | None, digest: int | None) -> int:
        self._before()
        token = next(self._tokens)
        if self._roll(self.spec.drop_rate):
            self._drop(token)
            return token
        if self._roll(self.spec.corrupt_rate):
            if checksum is not None and digest is None:
                digest = checksum.compute(src)  # of the caller's true bytes, as the caller's is
            damaged = bytearray(src)
            self._flip(memoryview(damaged))
            src = memoryview(damaged)  # sent before start_write returns: may die after
        inner = cast(PipelinedTransport, self.inner)
        inner_token = inner.start_write(segment, offset, src, checksum=checksum, digest=digest)
        self._inner_tokens[inner_token] = (token, None)
        return token

    def next_completion(self) -> Completion:
        """Injected drops come back first; then the wrapped transport's replies, a read's bytes
        possibly corrupted after they arrived (its digest still that of the true bytes)."""
        if self._ready:
            return self._ready.popleft()
        done = cast(PipelinedTransport, self.inner).next_completion()
        token, dest = self._inner_tokens.pop(done.token)
        if done.error is None and dest is not None and self._roll(self.spec.corrupt_rate):
            self._flip(dest)  # after the inner transport's own check: the caller must re-check
            return Completion(token, done.digest, done.error, verified=False)
        return Completion(token, done.digest, done.error, done.verified)

    def close(self) -> None:
        self.inner.close()

    def _drop(self, token: int) -> None:
        self.num_dropped += 1
        self._ready.append(Completion(token, error=TransportError("injected drop")))

    def _before(self) -> None:
        if self.spec.hold is not None:
            self.spec.hold.wait()
        if self._roll(self.spec.delay_rate):
            time.sleep(self.spec.delay_s)

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    def _flip(self, data: memoryview) -> None:
        position = self._rng.randrange(len(data))
        data[position] ^= 1 << self._rng.randrange(8)
        self.num_corrupted += 1

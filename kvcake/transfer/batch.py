"""Progress of one submitted batch, shared by the rail threads that work on it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvcake.transfer.request import BatchId, BatchStatus, RequestState, RequestStatus


class Batch:
    """Counts settled slices per request.

    A request fails at its first unrecoverable slice; its queued slices are then skipped, and it
    reports FAILED only once none of its slices is still in flight, so a caller that sees a
    finished batch may reuse every buffer of it at once.
    """

    def __init__(self, batch_id: BatchId, lengths: Sequence[int], num_slices: Sequence[int]) -> None:
        self.batch_id = batch_id
        self._lengths = list(lengths)
        self._bytes_done = [0] * len(lengths)
        self._slices_left = list(num_slices)
        self._errors: list[str | None] = [None] * len(lengths)
        self._requests_left = len(lengths)
        self._lock = threading.Lock()
        self._finished = threading.Event()

    def slice_done(self, request_index: int, num_bytes: int) -> None:
        with self._lock:
            if self._errors[request_index] is None:
                self._bytes_done[request_index] += num_bytes
            self._settle(request_index)

    def slice_failed(self, request_index: int, error: str) -> None:
        """A slice failed for good: its request fails (first error wins)."""
        with self._lock:
            if self._errors[request_index] is None:
                self._errors[request_index] = error
            self._settle(request_index)

    def slice_skipped(self, request_index: int) -> None:
        """A slice of an already failed request was dropped unmoved."""
        with self._lock:
            self._settle(request_index)

    def has_failed(self, request_index: int) -> bool:
        return self._errors[request_index] is not None

    def wait(self, timeout_s: float | None) -> bool:
        """True once every request has finished (done or failed); False on timeout."""
        return self._finished.wait(timeout_s)

    def status(self) -> BatchStatus:
        with self._lock:
            return BatchStatus(self.batch_id, tuple(self._request_status(i)
                                                    for i in range(len(self._lengths))))

    def _request_status(self, i: int) -> RequestStatus:
        if self._slices_left[i] > 0:
            state = RequestState.PENDING
        elif self._errors[i] is not None:
            state = RequestState.FAILED
        else:
            state = RequestState.DONE
        return RequestStatus(state, self._bytes_done[i], self._lengths[i], self._errors[i])

    def _settle(self, request_index: int) -> None:
        self._slices_left[request_index] -= 1
        if self._slices_left[request_index] == 0:
            self._requests_left -= 1
            if self._requests_left == 0:
                self._finished.set()

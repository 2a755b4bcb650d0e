"""Progress of one submitted batch, shared by the rail threads that work on it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvcake.transfer.request import BatchId, BatchStatus, RequestState, RequestStatus


class Batch:
    """Counts finished slices per request; a request fails at its first unrecoverable slice."""

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
            if self._errors[request_index] is not None:
                return
            self._bytes_done[request_index] += num_bytes
            self._slices_left[request_index] -= 1
            if self._slices_left[request_index] == 0:
                self._request_finished()

    def fail(self, request_index: int, error: str) -> None:
        """Mark the request failed (first error wins); its remaining slices are skipped."""
        with self._lock:
            if self._errors[request_index] is not None or self._slices_left[request_index] == 0:
                return
            self._errors[request_index] = error
            self._request_finished()

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
        if self._errors[i] is not None:
            state = RequestState.FAILED
        elif self._slices_left[i] == 0:
            state = RequestState.DONE
        else:
            state = RequestState.PENDING
        return RequestStatus(state, self._bytes_done[i], self._lengths[i], self._errors[i])

    def _request_finished(self) -> None:
        self._requests_left -= 1
        if self._requests_left == 0:
            self._finished.set()

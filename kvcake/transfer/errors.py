"""Errors of the transfer engine.

`TransferError` is what a caller sees when a request fails for good. `TransportError` is what one
endpoint raises for one slice; the engine decides whether to retry it on another rail.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer request failed after its retries, or was rejected by the remote side."""


class TransferTimeout(TimeoutError):
    """`wait` ran out of time before every request of the batch finished."""


class TransportError(OSError):
    """One slice failed on one endpoint.

    `retryable` is True for faults of the path (connection lost, checksum mismatch, injected drop):
    the slice goes to another rail. It is False when the remote side rejected the request itself
    (unknown segment, range out of bounds): retrying elsewhere cannot help.
    """

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable

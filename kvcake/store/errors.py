"""Errors of the store. Each has a stable wire name so a remote master's error is raised again,
with the same type, in the client."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every store error."""


class ObjectNotFound(StoreError, KeyError):
    """No committed object has this key (never put, removed, evicted, or lost with its node)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class ObjectUnavailable(ObjectNotFound):
    """The master lists the object, but no replica could be reached (their nodes are down)."""


class InvalidRequest(StoreError, ValueError):
    """Bad input: empty key, wrong type, object larger than any segment, malformed frame."""


class NoSpace(StoreError):
    """The pool cannot hold the object even after evicting everything it may evict."""


class NoNodes(StoreError):
    """No live node contributes a segment."""


class ObjectExists(StoreError):
    """The key is committed or being written already (keys name content: the first write wins)."""


class TransferFailed(StoreError):
    """No replica could be read or written with correct bytes."""


class MasterUnavailable(StoreError, ConnectionError):
    """The master cannot be reached."""


WIRE_ERRORS: dict[str, type[StoreError]] = {
    cls.__name__: cls
    for cls in (StoreError, ObjectNotFound, ObjectUnavailable, InvalidRequest, NoSpace, NoNodes, ObjectExists,
                TransferFailed, MasterUnavailable)
}

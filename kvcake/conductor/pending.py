"""Blocks placed on a prefill instance but not computed yet: local to it, fetchable by nobody.

When a request is placed, the blocks its prefill will compute are not there yet. The instance
itself will have them by the time a later request queued behind it runs (its queue is FIFO), so
for that instance they count as its local prefix; no other instance may plan to fetch them, since
there is nothing to read until the prefill ends and the caller reports the blocks stored
(`Conductor.on_blocks_stored`). This book keeps those pending blocks, per request, so they leave
it when the request's prefill finishes or the request is aborted. Overlapping requests on one
instance share blocks: each block is counted, and leaves the match when its last request does.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvcake.conductor.index import GlobalIndex, PrefixMatch


class PendingBlocks:
    """Per-request pending blocks of prefill instances, matched like the global index."""

    def __init__(self) -> None:
        self._index = GlobalIndex()
        self._counts: dict[str, dict[Hashable, int]] = {}  # holder -> key -> requests pending it
        self._by_request: dict[str, tuple[tuple[str, ...], tuple[Hashable, ...]]] = {}

    def __len__(self) -> int:
        """Requests with pending blocks."""
        return len(self._by_request)

    def add(self, request_id: str, holders: Sequence[str], keys: Sequence[Hashable]) -> None:
        """`request_id`'s prefill on `holders` (one instance, or a CPP group) will compute
        `keys` (replaces an earlier booking)."""
        self.release(request_id)
        keys = tuple(keys)
        self._by_request[request_id] = (tuple(holders), keys)
        for holder in holders:
            counts = self._counts.setdefault(holder, {})
            new = []
            for key in keys:
                n = counts.get(key, 0)
                counts[key] = n + 1
                if n == 0:
                    new.append(key)
            self._index.add(holder, new)

    def release(self, request_id: str) -> None:
        """The prefill of `request_id` finished (its blocks are reported stored) or was aborted."""
        booked = self._by_request.pop(request_id, None)
        if booked is None:
            return
        holders, keys = booked
        for holder in holders:
            counts = self._counts.get(holder, {})
            gone = []
            for key in keys:
                n = counts.get(key, 0) - 1
                if n > 0:
                    counts[key] = n
                else:
                    counts.pop(key, None)
                    gone.append(key)
            self._index.remove(holder, gone)

    def remove_holder(self, holder: str) -> None:
        for request_id, (holders, keys) in list(self._by_request.items()):
            if holder in holders:
                self._by_request[request_id] = (tuple(h for h in holders if h != holder), keys)
        self._counts.pop(holder, None)
        self._index.remove_holder(holder)

    def match(self, keys: Sequence[Hashable]) -> PrefixMatch | None:
        """Pending prefix blocks per holder, or None when nothing is pending (the common case
        on an idle cluster: no second pass over the keys)."""
        return self._index.match(keys) if self._by_request else None

"""`decode_node_guard`: a decode node takes a request after prefill only if it can start it at once.

The guard counts, per decode node, the KV tokens of the requests sent to it that have not joined
its batch yet (committed), beside the KV its batch reserves. A request that waited at the node
for memory would hold its first decode gap for the wait, over the TBT SLO.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcake.sim.decode import DecodeInstance


class DecodeNodeGuard:
    """KV committed to each decode node by requests on their way to it."""

    def __init__(self, num_decode: int, kv_capacity_tokens: int) -> None:
        self.kv_capacity_tokens = kv_capacity_tokens
        self._committed = [0] * num_decode
        self._commit_of: dict[int, tuple[int, int]] = {}  # request -> (decode node, tokens)

    def place(self, req: int, need: int, chosen: int,
              decodes: Sequence[DecodeInstance], only_chosen: bool = False) -> int | None:
        """The decode node that takes request `req` (`need` KV tokens): `chosen` if it has the
        room, else (unless `only_chosen`) the node with the most room if that is enough, else
        None. The request's KV is committed to the node returned until `release`."""
        room = [self.kv_capacity_tokens - inst.kv_tokens - self._committed[d]
                for d, inst in enumerate(decodes)]
        d = (chosen if room[chosen] >= need or only_chosen
             else max(range(len(room)), key=room.__getitem__))
        if room[d] < need:
            return None
        self._committed[d] += need
        self._commit_of[req] = (d, need)
        return d

    def hand_off(self, req: int, need: int, chosen: int,
                 decodes: Sequence[DecodeInstance]) -> int:
        """Re-selection at hand-off (an arrival decision that is final): `chosen` if it has
        room for `need` KV tokens, else the node with the most room if that is enough, else
        `chosen` (the request waits there for memory). Room counts the requests on their way to
        or waiting at a node; the request's KV is committed to the node returned until
        `release`."""
        room = [self.kv_capacity_tokens - inst.kv_tokens - self._committed[d]
                for d, inst in enumerate(decodes)]
        d = chosen if room[chosen] >= need else max(range(len(room)), key=room.__getitem__)
        if room[d] < need:
            d = chosen
        self._committed[d] += need
        self._commit_of[req] = (d, need)
        return d

    def release(self, req: int) -> None:
        """Request `req` joined its node's batch (or finished): its KV is the batch's now."""
        commit = self._commit_of.pop(req, None)
        if commit is not None:
            self._committed[commit[0]] -= commit[1]

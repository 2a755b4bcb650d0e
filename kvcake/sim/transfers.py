"""The cluster's transfers on the network: each flow tagged with what it carries for which request.

A transfer is a prefix fetch (blocks from their holder to the prefill node) or a KV hand-off (a
prefill node's share of a request's KV to its decode node). A KV hand-off carries the request's
KV epoch: when the decode node is chosen again the request's epoch moves on, and flows of an
older epoch still finish but no longer count.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvcake.conductor import FetchPlan
from kvcake.sim.events import Event, EventKind
from kvcake.sim.network import Network


class TransferKind(enum.Enum):
    FETCH = "fetch"
    KV = "kv"


@dataclass(frozen=True, slots=True)
class Transfer:
    kind: TransferKind
    req: int  # the request's index
    epoch: int = 0  # KV: the request's KV epoch when the flow started


class Transfers:
    """Flows in flight on `network`, each with its `Transfer`; FLOW_DONE events to drive them."""

    def __init__(self, network: Network) -> None:
        self.network = network
        self._in_flight: dict[int, Transfer] = {}  # flow id -> what it carries
        self._next_flow = 0

    def start(self, now_s: float, transfer: Transfer, src: int, dst: int,
              num_bytes: float) -> None:
        """Start moving `num_bytes` of `transfer` from node `src` to node `dst`."""
        flow_id = self._next_flow
        self._next_flow += 1
        self._in_flight[flow_id] = transfer
        self.network.start_flow(now_s, flow_id, src, dst, num_bytes)

    def next_event(self) -> list[Event]:
        """The FLOW_DONE event of the next flow to finish, if any is in flight."""
        finish_s = self.network.next_finish_s()
        if finish_s is None:
            return []
        return [Event(finish_s, EventKind.FLOW_DONE, 0, self.network.version)]

    def stale(self, event: Event) -> bool:
        """Whether the flows changed since `event` (a FLOW_DONE) was scheduled."""
        return event.token != self.network.version

    def landed(self, now_s: float) -> list[Transfer]:
        """The transfers whose flows have finished by `now_s`, in the network's order."""
        return [self._in_flight.pop(flow_id) for flow_id in self.network.advance(now_s)]


def fetch_tokens_by_node(fetch: FetchPlan, block_size: int,
                         holder_node: Callable[[Hashable], int]) -> dict[int, int]:
    """Tokens of `fetch` each node sends, `holder_node(key)` holding block `key` (the first and
    last blocks may be partial: the fetch covers tokens start_len..end_len)."""
    first_block = -(-fetch.end_len // block_size) - len(fetch.keys)  # absolute index of keys[0]
    by_node: dict[int, int] = {}
    for i, key in enumerate(fetch.keys):
        begin = max((first_block + i) * block_size, fetch.start_len)
        tokens = min((first_block + i + 1) * block_size, fetch.end_len) - begin
        node = holder_node(key)
        by_node[node] = by_node.get(node, 0) + max(0, tokens)
    return by_node

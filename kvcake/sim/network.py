"""A bandwidth-limited network with contention: per-node NICs shared max-min fairly by flows.

Each node has one NIC of `nic_bytes_per_s` in each direction (full duplex). A flow from node `s`
to node `d` crosses two links, `s`'s egress and `d`'s ingress. Concurrent flows share links by
max-min fairness (progressive filling): the most contended link splits its capacity evenly among
its flows, those flows are fixed at that rate, and the rest share what is left. Rates change
only when a flow starts or ends, so between those moments every flow moves at a constant rate
and its finish time is exact arithmetic.

The owner drives it: `start_flow` and `advance(now_s)` at event times, `next_finish_s()` to
schedule the next FLOW_DONE event, and `version` to recognise a stale one.
"""

from __future__ import annotations

from dataclasses import dataclass

_EPS_S = 1e-12


@dataclass(slots=True)
class Flow:
    flow_id: int
    src: int
    dst: int
    num_bytes: float
    remaining_bytes: float
    rate_bytes_per_s: float = 0.0


class Network:
    """Max-min fair sharing of per-node NIC bandwidth among concurrent flows."""

    def __init__(self, num_nodes: int, nic_bytes_per_s: float) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if not nic_bytes_per_s > 0:
            raise ValueError(f"NIC bandwidth must be > 0 bytes/s, got {nic_bytes_per_s}")
        self.num_nodes = num_nodes
        self.nic_bytes_per_s = float(nic_bytes_per_s)
        self._flows: dict[int, Flow] = {}
        self._updated_s = 0.0
        self.version = 0  # bumped whenever the set of flows (hence every finish time) changes
        self.total_bytes = 0.0

    @property
    def num_flows(self) -> int:
        return len(self._flows)

    def flow(self, flow_id: int) -> Flow:
        return self._flows[flow_id]

    def start_flow(self, now_s: float, flow_id: int, src: int, dst: int, num_bytes: float) -> None:
        """Start moving `num_bytes` from node `src` to node `dst` at `now_s`.

        Flows that finish at `now_s` stay until `advance` reports them (nothing is dropped).
        A flow within one node (`src == dst`) is the caller's business: it never crosses a NIC.
        """
        for name, node in (("src", src), ("dst", dst)):
            if not 0 <= node < self.num_nodes:
                raise ValueError(f"{name} node {node} is not in 0..{self.num_nodes - 1}")
        if src == dst:
            raise ValueError(f"flow {flow_id}: src and dst are both node {src}; no NIC is crossed")
        if num_bytes <= 0:
            raise ValueError(f"flow {flow_id}: num_bytes must be > 0, got {num_bytes}")
        if flow_id in self._flows:
            raise ValueError(f"flow {flow_id} is already running")
        self._move(now_s)
        self._flows[flow_id] = Flow(flow_id, src, dst, float(num_bytes), float(num_bytes))
        self.total_bytes += num_bytes
        self._reshare()

    def next_finish_s(self) -> float | None:
        """When the next flow finishes if nothing else changes; None when idle."""
        if not self._flows:
            return None
        return min(
            self._updated_s + f.remaining_bytes / f.rate_bytes_per_s for f in self._flows.values()
        )

    def advance(self, now_s: float) -> list[int]:
        """Move time to `now_s`; remove and return (in id order) the flows finished by then."""
        if now_s < self._updated_s - _EPS_S:
            raise ValueError(f"network time cannot go back from {self._updated_s} to {now_s}")
        done = sorted(
            f.flow_id
            for f in self._flows.values()
            if self._updated_s + f.remaining_bytes / f.rate_bytes_per_s <= now_s + _EPS_S
        )
        self._move(now_s)
        for flow_id in done:
            del self._flows[flow_id]
        if done:
            self._reshare()
        return done

    def _move(self, now_s: float) -> None:
        elapsed = max(0.0, now_s - self._updated_s)
        if elapsed > 0:
            for f in self._flows.values():
                f.remaining_bytes = max(0.0, f.remaining_bytes - f.rate_bytes_per_s * elapsed)
        self._updated_s = max(self._updated_s, now_s)

    def _reshare(self) -> None:
        """Progressive filling over the egress (2*node) and ingress (2*node+1) links."""
        self.version += 1
        capacity: dict[int, float] = {}
        members: dict[int, list[Flow]] = {}
        for f in self._flows.values():
            for link in (2 * f.src, 2 * f.dst + 1):
                capacity[link] = self.nic_bytes_per_s
                members.setdefault(link, []).append(f)
        unfixed = set(self._flows)
        while unfixed:
            # The bottleneck: least capacity per unfixed flow; ties go to the lowest link id.
            best_link, best_share = -1, float("inf")
            for link in sorted(members):
                count = sum(1 for f in members[link] if f.flow_id in unfixed)
                if count and capacity[link] / count < best_share:
                    best_link, best_share = link, capacity[link] / count
            for f in members[best_link]:
                if f.flow_id not in unfixed:
                    continue
                f.rate_bytes_per_s = best_share
                unfixed.discard(f.flow_id)
                for link in (2 * f.src, 2 * f.dst + 1):
                    capacity[link] -= best_share

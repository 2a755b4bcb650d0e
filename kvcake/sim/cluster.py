"""The simulated cluster: instances, network and the Conductor, driven by one event loop.

The path of one request (disaggregated policies):

    ARRIVAL      Conductor.schedule -> Placement (p, d, fetch?) or Rejection (recorded, done)
    fetch        if planned: flows from the holder's node(s) to p's node; the fetched blocks
                 join p's cache (hotspot replication) when they land
    prefill      FIFO on p; at its start the KV stream to d starts (layer-wise, overlapped);
                 PREFILL_DONE is the first token; p caches the prompt's blocks (and the store
                 tier, if any, takes them too)
    hand-off     at PREFILL_DONE d is settled (handoff.py): a decode check after prefill may
                 reject the request or move it to another decode node (its KV streamed again)
    decode       when the prefill is done and the KV stream has landed, the request joins d's
                 continuous batch at the next step boundary; it finishes after output_len - 1
                 more tokens

Colocated (vLLM-like): the Conductor (policy colocated) picks one instance, which prefills (with
its HBM prefix cache) and then decodes the request itself; nothing crosses the network.

Nodes: prefill instance i is node i, decode instance j is node num_prefill + j (built from the
config in topology.py; the network's flows in transfers.py, the hand-off to decode (KV streams,
the decode node settled when the prefill ends) in handoff.py, a live profile's shared host in
host.py, the colocated HBM cache in colocated.py). The Conductor is used unchanged: the simulator
only reports to it what happened (starts, finishes, cache changes), as the live frontend will.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

from kvcake.conductor import CostModel, Placement, ScheduleRequest
from kvcake.sim.cache import BlockLRU
from kvcake.sim.colocated import cache_in_free_hbm, place_colocated
from kvcake.sim.config import SimConfig
from kvcake.sim.decode import Seq
from kvcake.sim.events import Event, EventKind, EventQueue
from kvcake.sim.guard import DecodeNodeGuard
from kvcake.sim.handoff import DecodeHandoff
from kvcake.sim.host import SharedHost
from kvcake.sim.network import Network
from kvcake.sim.prefill import QueuedPrefill
from kvcake.sim.records import Arrival, RequestState, summarize
from kvcake.sim.topology import (
    build_conductor,
    build_topology,
    cost_model,
    kv_capacity_tokens,
    nic_bytes_per_s,
    told_output_len,
)
from kvcake.sim.transfers import Transfer, TransferKind, Transfers, fetch_tokens_by_node

__all__ = ["STORE", "Cluster", "cost_model", "kv_capacity_tokens"]

STORE = "store"  # the Conductor's holder name of the pooled store tier


class Cluster:
    """One simulated run of `arrivals` (sorted by time) on the cluster `config` describes."""

    def __init__(self, config: SimConfig, arrivals: Sequence[Arrival],
                 cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost_model(config) if cost is None else cost  # cost: a live profile's
        self.kv_per_token = self.cost.model.kv_bytes_per_token
        self.kv_capacity_tokens = kv_capacity_tokens(self.cost)
        nodes = build_topology(config, self.cost, self.kv_capacity_tokens)
        self.prefills, self.decodes = nodes.prefills, nodes.decodes
        self.hbm_caches = nodes.hbm_caches  # colocated: each instance's HBM prefix cache
        self.prefill_ids, self.decode_ids = nodes.prefill_ids, nodes.decode_ids
        self._prefill_index = {name: i for i, name in enumerate(nodes.prefill_ids)}
        self._decode_index = {name: i for i, name in enumerate(nodes.decode_ids)}
        self.store = (BlockLRU(config.store_tokens // config.block_size) if config.store_tokens
                      else None)
        self.num_nodes = config.num_prefill + config.num_decode
        self.network = Network(max(2, self.num_nodes), nic_bytes_per_s(config, self.cost))
        self.transfers = Transfers(self.network)
        self.predicted_output_len = told_output_len(config, arrivals)
        self.conductor = build_conductor(config, self.cost, nodes, arrivals)
        self.states = [RequestState(i, f"req-{i}", a) for i, a in enumerate(arrivals)]
        self.queue = EventQueue()
        self.num_events = 0
        self.local_fetch_tokens = 0
        self.guard = DecodeNodeGuard(len(self.decodes), self.kv_capacity_tokens)
        told = replace(config, predicted_output_len=self.predicted_output_len)
        self.handoff = DecodeHandoff(told, self.conductor, self.transfers, self.guard,
                                     self.decode_ids, self.kv_per_token)

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Simulate every arrival to the end; return the summary."""
        for state in self.states:
            self.queue.push(Event(state.arrival.arrival_s, EventKind.ARRIVAL, state.index))
        handlers = {
            EventKind.ARRIVAL: self._on_arrival,
            EventKind.FLOW_DONE: self._on_flow_done,
            EventKind.PREFILL_DONE: self._on_prefill_done,
            EventKind.DECODE_STEP_DONE: self._on_step_done,
        }
        queue = self.queue
        host = SharedHost(self.prefills, self.decodes, self.cost, self.config.colocated)
        while len(queue):
            event = queue.pop()
            self.num_events += 1
            for follow in handlers[event.kind](event):
                queue.push(follow)
            for d in host.coupled:  # a live profile's host: decode runs follow its prefills
                if (cut := d.follow_host(event.time_s)) is not None:
                    queue.push(cut)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.colocated:
            compute_s = sum(d.prefill_compute_s for d in self.decodes)
        else:
            compute_s = sum(p.busy_s for p in self.prefills)
        end_s = max((s.finish_s or 0.0 for s in self.states), default=0.0)
        extra = {
            "policy": cfg.policy,
            "prefill_instances": 0 if cfg.colocated else cfg.num_prefill,
            "decode_instances": len(self.decodes),
            "prefill_compute_s": compute_s,
            "transfer_bytes": int(self.network.total_bytes),
            "makespan_s": end_s,
            "num_events": self.num_events,
            # Rejected for TTFT although their prefill alone, uncached on one idle node, already
            # exceeds the TTFT SLO: rejected only because they are long (CPP's target).
            "decode_preemptions": sum(d.preemptions for d in self.decodes),
            "ttft_rejected_long": sum(
                1 for s in self.states if s.rejected == "ttft_slo"
                and self.cost.prefill_time_s(s.arrival.input_len) > cfg.ttft_slo_s),
        }
        return summarize(self.states, cfg.ttft_slo_s, cfg.tbt_slo_ms / 1000.0, extra)

    # ---- arrival and placement ---------------------------------------------------------------

    def _on_arrival(self, event: Event) -> list[Event]:
        state = self.states[event.target]
        a = state.arrival
        req = ScheduleRequest(state.request_id, a.input_len, a.block_keys, self.config.block_size,
                              self.predicted_output_len)
        decision = self.conductor.schedule(req, event.time_s)
        if not isinstance(decision, Placement):
            state.rejected = decision.reason.value
            state.predicted_ttft_s = decision.predicted_ttft_s
            return []
        state.prefill_instance, state.decode_instance = decision.prefill_id, decision.decode_id
        state.preselected_decode = decision.decode_id
        state.predicted_ttft_s = decision.predicted_ttft_s
        if self.config.colocated:
            return self._place_colocated(state, event.time_s)
        state.prefix_len = decision.prefix_len
        state.prefill_group = tuple(self._prefill_index[m] for m in decision.prefill_group)
        if decision.fetch is None:
            return self._enqueue_prefill(state, event.time_s)
        state.fetched_len = decision.fetch.num_tokens
        return self._start_fetch(state, decision, event.time_s)

    def _start_fetch(self, state: RequestState, decision: Placement, now_s: float) -> list[Event]:
        fetch = decision.fetch
        assert fetch is not None
        dst = self._prefill_index[decision.prefill_id]
        by_node = fetch_tokens_by_node(fetch, self.config.block_size,
                                       lambda key: self._holder_node(fetch.source, key))
        for node in sorted(by_node):
            if node == dst or by_node[node] == 0:
                self.local_fetch_tokens += by_node[node]
                continue
            state.pending_fetches += 1
            self.transfers.start(now_s, Transfer(TransferKind.FETCH, state.index), node, dst,
                                 by_node[node] * self.kv_per_token)
        if state.pending_fetches == 0:
            return self._fetch_landed(state, now_s)
        return self.transfers.next_event()

    def _holder_node(self, holder: str, key: Hashable) -> int:
        """The node whose memory holds `key` for `holder`: a prefill node, or for the store tier
        a decode node chosen by key (the store pools the decode nodes' DRAM)."""
        if holder == STORE:
            return self.config.num_prefill + hash(key) % self.config.num_decode
        return self._prefill_index[holder]

    def _fetch_landed(self, state: RequestState, now_s: float) -> list[Event]:
        self.conductor.on_transfer_done(state.request_id, now_s)
        state.fetch_s = now_s - state.arrival.arrival_s
        keys = state.arrival.block_keys
        for p in self._prefill_nodes(state):  # a CPP group: every member keeps its layers
            self._cache_insert(p, keys[: -(-state.prefix_len // self.config.block_size)])
        return self._enqueue_prefill(state, now_s)

    def _prefill_nodes(self, state: RequestState) -> tuple[int, ...]:
        return state.prefill_group or (self._prefill_index[state.prefill_instance or ""],)

    def _enqueue_prefill(self, state: RequestState, now_s: float) -> list[Event]:
        block = self.config.block_size
        keys = state.arrival.block_keys
        a, cfg = state.arrival, self.config
        for p in self._prefill_nodes(state):
            self.prefills[p].cache.touch(keys[: -(-state.prefix_len // block)])
        if state.prefill_group:  # CPP: one item in every member's queue, started together
            prefill_s = self.cost.cpp_prefill_time_s(a.input_len, state.prefix_len,
                                                     len(state.prefill_group), cfg.cpp_chunk_tokens)
            item = QueuedPrefill(state.index, prefill_s, state.prefill_group)
            for p in state.prefill_group:
                self.prefills[p].enqueue(now_s, item)
            return self._start_gang(state.prefill_group[0], now_s)
        p = self._prefill_index[state.prefill_instance or ""]
        prefill_s = self.cost.prefill_time_s(a.input_len, state.prefix_len)
        event = self.prefills[p].enqueue(now_s, QueuedPrefill(state.index, prefill_s))
        return self._prefill_started(p, now_s, event)

    def _prefill_started(self, p: int, now_s: float, event: Event | None) -> list[Event]:
        """Report a prefill that just started on p (or a CPP prefill now heading p's queue, if
        its whole group is free) and start streaming its KV to its decode node."""
        if event is None:
            return self._start_gang(p, now_s)
        started = self.prefills[p].running
        assert started is not None
        return [event, *self._report_start(p, started, now_s)]

    def _start_gang(self, p: int, now_s: float) -> list[Event]:
        """Start the CPP prefill heading p's queue if every member of its group is free for it."""
        instance = self.prefills[p]
        if instance.running is not None or not instance.queue or not instance.queue[0].group:
            return []
        item = instance.queue[0]
        if not all(self.prefills[m].ready_for(item) for m in item.group):
            return []
        events = [self.prefills[m].start_gang(now_s) for m in item.group]
        return events + self._report_start(item.group[0], item, now_s)

    def _report_start(self, p: int, started: QueuedPrefill, now_s: float) -> list[Event]:
        state = self.states[started.req]
        state.prefill_start_s = now_s
        self.conductor.on_prefill_started(self.prefill_ids[p], state.request_id, now_s)
        # the KV streams to the decode node from the start (each CPP member sends its layers')
        return self.handoff.stream(state, started.group or (p,), now_s)

    # ---- completions -------------------------------------------------------------------------

    def _on_prefill_done(self, event: Event) -> list[Event]:
        p, now_s = event.target, event.time_s
        done, nxt = self.prefills[p].on_done(now_s)
        if done.group and p != done.group[0]:  # a CPP member: the lead reports the request
            return self._prefill_started(p, now_s, nxt)
        state = self.states[done.req]
        state.prefill_done = True
        state.prefill_s = done.prefill_s
        self.conductor.on_prefill_finished(self.prefill_ids[p], state.request_id, now_s)
        for member in done.group or (p,):
            self._cache_insert(member, state.arrival.block_keys)
        if self.store is not None:
            keys = state.arrival.block_keys
            self._report_stored(STORE, keys, self.store.insert(keys))
        events = self._prefill_started(p, now_s, nxt)
        events += self.handoff.at_prefill_end(state, p, now_s, self.decodes)
        if state.rejected is not None:  # rejected after prefill: the prefill was spent for nothing
            return events
        state.first_token_s = now_s
        if state.kv_arrived:
            events.extend(self._to_decode(state, now_s))
        return events

    def _to_decode(self, state: RequestState, now_s: float) -> list[Event]:
        if state.arrival.output_len <= 1:  # the prefill's token was the only one
            self.guard.release(state.index)
            state.finish_s = now_s
            self.conductor.on_decode_finished(state.decode_instance or "", state.request_id, now_s)
            return []
        d = self._decode_index[state.decode_instance or ""]
        a = state.arrival
        # The node reserves what a live one knows: the prompt and the output length it was told
        # (never the request's true length); a longer request grows past it (decode.py).
        seq = Seq(state.index, a.input_len, a.output_len - 1,
                  a.input_len + self.predicted_output_len, state.first_token_s or now_s,
                  state.gaps)
        event = self.decodes[d].add(now_s, seq)
        self._report_joined(d, now_s)
        return [] if event is None else [event]

    def _report_joined(self, d: int, now_s: float) -> None:
        """Tell the Conductor which requests started decoding on d (had room for their KV)."""
        for seq in self.decodes[d].take_joined():
            state = self.states[seq.req]
            self.guard.release(seq.req)
            state.decode_join_s = now_s
            self.conductor.on_decode_joined(self.decode_ids[d], state.request_id, now_s)
        if self.config.decode_node_guard:
            self.conductor.on_decode_kv(self.decode_ids[d], self.decodes[d].kv_tokens)

    def _on_step_done(self, event: Event) -> list[Event]:
        d, now_s = event.target, event.time_s
        instance = self.decodes[d]
        first_tokens, finished, nxt = instance.on_step_done(now_s, event.token)
        name = self.decode_ids[d]
        if not self.config.colocated:
            self._report_joined(d, now_s)
        for seq in first_tokens:  # colocated prefills that just finished
            state = self.states[seq.req]
            state.first_token_s = now_s
            self.conductor.on_prefill_finished(name, state.request_id, now_s)
            self.conductor.on_decode_joined(name, state.request_id, now_s)
            self._hbm_insert(d, state.arrival.block_keys)
        if self.config.colocated:
            self._report_colocated_started(d, now_s)
        for seq in finished:
            state = self.states[seq.req]
            state.finish_s = now_s
            self.conductor.on_decode_finished(name, state.request_id, now_s)
        if self.config.decode_node_guard and not self.config.colocated:
            self.conductor.on_decode_kv(name, instance.kv_tokens)
        return [] if nxt is None else [nxt]

    # ---- network -----------------------------------------------------------------------------

    def _on_flow_done(self, event: Event) -> list[Event]:
        if self.transfers.stale(event):
            return []  # the flows changed since this was scheduled
        events: list[Event] = []
        for landed in self.transfers.landed(event.time_s):
            state = self.states[landed.req]
            if landed.kind is TransferKind.KV and landed.epoch != state.kv_epoch:
                continue  # streamed toward a decode node no longer chosen
            if landed.kind is TransferKind.FETCH:
                state.pending_fetches -= 1
                if state.pending_fetches == 0:
                    events.extend(self._fetch_landed(state, event.time_s))
            else:
                state.pending_kv -= 1
                if state.pending_kv > 0:
                    continue
                state.kv_arrived = True
                if state.prefill_done and state.rejected is None:
                    state.kv_wait_s = event.time_s - (state.first_token_s or event.time_s)
                    events.extend(self._to_decode(state, event.time_s))
        events.extend(self.transfers.next_event())
        return events

    # ---- caches ------------------------------------------------------------------------------

    def _cache_insert(self, p: int, keys: Sequence[int]) -> None:
        self._report_stored(self.prefill_ids[p], keys, self.prefills[p].cache.insert(keys))

    def _report_stored(self, holder: str, keys: Sequence[int], evicted: list[int]) -> None:
        self.conductor.on_blocks_stored(holder, keys)
        if evicted:
            self.conductor.on_blocks_removed(holder, evicted)

    # ---- colocated ---------------------------------------------------------------------------

    def _place_colocated(self, state: RequestState, now_s: float) -> list[Event]:
        i = self._prefill_index[state.prefill_instance or ""]
        events = place_colocated(self.decodes[i], self.hbm_caches[i], state,
                                 self.config.block_size, now_s)
        self._report_colocated_started(i, now_s)
        return events

    def _report_colocated_started(self, i: int, now_s: float) -> None:
        """Tell the Conductor which prefills colocated instance i began (its first chunk is
        scheduled): the live worker's `PrefillStarted`, from which its queue runs them down."""
        for seq in self.decodes[i].take_started():
            self.conductor.on_prefill_started(self.prefill_ids[i], self.states[seq.req].request_id,
                                              now_s)

    def _hbm_insert(self, i: int, keys: Sequence[int]) -> None:
        """Cache a prompt's blocks in the free HBM of colocated instance i (LRU)."""
        if self.config.prefix_cache:
            self._report_stored(self.prefill_ids[i], keys, cache_in_free_hbm(
                self.decodes[i], self.hbm_caches[i], keys, self.kv_capacity_tokens,
                self.config.block_size))

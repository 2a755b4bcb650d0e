"""The simulated cluster: instances, network and the Conductor, driven by one event loop.

The path of one request (disaggregated policies):

    ARRIVAL      Conductor.schedule -> Placement (p, d, fetch?) or Rejection (recorded, done)
    fetch        if planned: flows from the holder's node(s) to p's node; the fetched blocks
                 join p's cache (hotspot replication) when they land
    prefill      FIFO on p; at its start the KV stream to d starts (layer-wise, overlapped);
                 PREFILL_DONE is the first token; p caches the prompt's blocks (and the store
                 tier, if any, takes them too)
    decode       when the prefill is done and the KV stream has landed, the request joins d's
                 continuous batch at the next step boundary; it finishes after output_len - 1
                 more tokens

Colocated (vLLM-like): the Conductor (policy colocated) picks one instance, which prefills (with
its HBM prefix cache) and then decodes the request itself; nothing crosses the network.

Nodes: prefill instance i is node i, decode instance j is node num_prefill + j. The Conductor is
used unchanged: the simulator only reports to it what happened (starts, finishes, cache
changes), as the live frontend will.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from kvcake.conductor import (
    Admission,
    Conductor,
    ConductorConfig,
    CostModel,
    DecodeEstimate,
    Placement,
    Policy,
    PrefillModel,
    PrefillTimePredictor,
    Rejection,
    ScheduleRequest,
    profile_grid,
)
from kvcake.sim.cache import BlockLRU
from kvcake.sim.config import SimConfig
from kvcake.sim.decode import DecodeInstance, Seq, StepCosts
from kvcake.sim.events import Event, EventKind, EventQueue
from kvcake.sim.network import Network
from kvcake.sim.prediction import NoisyPrefillModel
from kvcake.sim.prefill import PrefillInstance, QueuedPrefill
from kvcake.sim.records import Arrival, RequestState, summarize

STORE = "store"  # the Conductor's holder name of the pooled store tier
_HBM_RESERVE = 0.9  # share of HBM left to weights + KV after activations and workspace
_FETCH, _KV = 0, 1


def cost_model(config: SimConfig) -> CostModel:
    """The cost model of `config`'s profile, with its hardware overrides applied."""
    cost = CostModel.from_spec(config.profile)
    if not config.hardware_overrides:
        return cost
    fields = {f.name for f in dataclasses.fields(cost.hardware)}
    unknown = sorted({name for name, _ in config.hardware_overrides} - fields)
    if unknown:
        raise ValueError(f"unknown hardware profile fields {unknown}; known: {sorted(fields)}")
    overrides: dict[str, Any] = dict(config.hardware_overrides)
    return CostModel(cost.model, dataclasses.replace(cost.hardware, **overrides))


def kv_capacity_tokens(cost: CostModel) -> int:
    """KV tokens one decode node holds: its HBM less the weights and the activation reserve."""
    return max(1, int((cost.hardware.hbm_bytes * _HBM_RESERVE - cost.model.weight_bytes)
                      // cost.model.kv_bytes_per_token))


class Cluster:
    """One simulated run of `arrivals` (sorted by time) on the cluster `config` describes."""

    def __init__(self, config: SimConfig, arrivals: Sequence[Arrival],
                 cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost_model(config) if cost is None else cost  # cost: a live profile's
        model, hw = self.cost.model, self.cost.hardware
        self.kv_per_token = model.kv_bytes_per_token
        nic = hw.nic_bandwidth_bytes_per_s if config.nic_gbps is None else config.nic_gbps * 1e9 / 8
        self.kv_capacity_tokens = kv_capacity_tokens(self.cost)
        local_tokens = (hw.dram_bytes // self.kv_per_token if config.local_cache_tokens is None
                        else config.local_cache_tokens)
        block = config.block_size
        costs = StepCosts(self.cost.decode_step_time_s, self.cost.prefill_time_s,
                          self.cost.chunk_compute_s, hw.prefill_step_overhead_s)
        if config.colocated:
            n = config.num_prefill + config.num_decode
            self.prefills: list[PrefillInstance] = []
            self.decodes = [DecodeInstance(i, costs, self.kv_capacity_tokens, config.max_batch_size,
                                           colocated=True,
                                           chunk_budget_tokens=config.chunk_budget_tokens
                                           if config.chunked_prefill else None)
                            for i in range(n)]
            self.hbm_caches = [BlockLRU(self.kv_capacity_tokens // block if config.prefix_cache
                                        else 0) for _ in range(n)]
            prefill_ids = decode_ids = [f"colocated-{i}" for i in range(n)]
        else:
            self.prefills = [PrefillInstance(i, local_tokens // block)
                             for i in range(config.num_prefill)]
            self.decodes = [DecodeInstance(i, costs, self.kv_capacity_tokens, config.max_batch_size)
                            for i in range(config.num_decode)]
            self.hbm_caches = []
            prefill_ids = [f"prefill-{i}" for i in range(config.num_prefill)]
            decode_ids = [f"decode-{i}" for i in range(config.num_decode)]
        self.prefill_ids, self.decode_ids = prefill_ids, decode_ids
        self._prefill_index = {name: i for i, name in enumerate(prefill_ids)}
        self._decode_index = {name: i for i, name in enumerate(decode_ids)}
        self.store = BlockLRU(config.store_tokens // block) if config.store_tokens else None
        self.num_nodes = config.num_prefill + config.num_decode
        self.network = Network(max(2, self.num_nodes), nic)
        # The Conductor predicts prefill times with the paper's polynomial regression, fitted on
        # profile points of the cost model over (at least) the trace's range of lengths.
        max_input = max((a.input_len for a in arrivals), default=0)
        predictor: PrefillModel = PrefillTimePredictor.fit(
            profile_grid(self.cost, max(4096, max_input)))
        if config.prefill_prediction_error:
            predictor = NoisyPrefillModel(predictor, config.prefill_prediction_error, config.seed)
        # The Conductor never sees a request's true output length (a live one knows max_tokens
        # or a prediction): it is told one length for all, by default the trace's mean.
        self.predicted_output_len = config.predicted_output_len or max(1, round(
            sum(a.output_len for a in arrivals) / max(1, len(arrivals))))
        self.conductor = Conductor(
            ConductorConfig(
                policy=Policy(config.policy),
                admission=Admission.NONE if config.colocated else Admission(config.admission),
                kvcache_balancing_threshold=config.kvcache_balancing_threshold,
                ttft_slo_s=config.ttft_slo_s,
                tbt_slo_s=config.tbt_slo_ms / 1000.0,
                transfer_bandwidth_bytes_per_s=nic,
                index_on_placement=config.prefix_cache or not config.colocated,
                seed=config.seed,
                uniform_decode_s=config.uniform_decode_s,
                cpp_min_tokens=config.cpp_min_tokens,
                cpp_nodes=config.cpp_nodes,
                cpp_chunk_tokens=config.cpp_chunk_tokens,
                decode_kv_capacity_tokens=self.kv_capacity_tokens,
                decode_check_after_prefill=config.decode_check_after_prefill,
            ),
            prefill_ids, decode_ids, predictor, self.cost, self.kv_per_token,
        )
        self.states = [RequestState(i, f"req-{i}", a) for i, a in enumerate(arrivals)]
        self.queue = EventQueue()
        self._flows: dict[int, tuple[int, int, int]] = {}  # flow -> (_FETCH | _KV, request, epoch)
        self._next_flow = 0
        self.num_events = 0
        self.local_fetch_tokens = 0
        # decode_node_guard: KV tokens of the requests sent to each decode node, not joined yet.
        self._committed = [0] * len(self.decodes)
        self._commit_of: dict[int, tuple[int, int]] = {}

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
        while len(queue):
            event = queue.pop()
            self.num_events += 1
            for follow in handlers[event.kind](event):
                queue.push(follow)
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
        block = self.config.block_size
        first_block = -(-fetch.end_len // block) - len(fetch.keys)  # absolute index of keys[0]
        by_node: dict[int, int] = {}
        for i, key in enumerate(fetch.keys):
            begin = max((first_block + i) * block, fetch.start_len)
            tokens = min((first_block + i + 1) * block, fetch.end_len) - begin
            node = self._holder_node(fetch.source, key)
            by_node[node] = by_node.get(node, 0) + max(0, tokens)
        events: list[Event] = []
        for node in sorted(by_node):
            if node == dst or by_node[node] == 0:
                self.local_fetch_tokens += by_node[node]
                continue
            state.pending_fetches += 1
            self._start_flow(now_s, _FETCH, state.index, node, dst, by_node[node] * self.kv_per_token)
        if state.pending_fetches == 0:
            return self._fetch_landed(state, now_s)
        events.extend(self._flow_event())
        return events

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

    def _restream_kv(self, state: RequestState, p: int, now_s: float) -> None:
        """The KV streamed toward the first decode choice is sent to the new one instead (its
        flows already in flight still finish; they no longer count)."""
        d = self._decode_index[state.decode_instance or ""]
        state.kv_arrived = False
        state.kv_epoch += 1
        senders = state.prefill_group or (p,)
        state.pending_kv = len(senders)
        for sender in senders:
            self._start_flow(now_s, _KV, state.index, sender, self.config.num_prefill + d,
                             state.arrival.input_len * self.kv_per_token / len(senders),
                             state.kv_epoch)

    def _report_start(self, p: int, started: QueuedPrefill, now_s: float) -> list[Event]:
        state = self.states[started.req]
        state.prefill_start_s = now_s
        self.conductor.on_prefill_started(self.prefill_ids[p], state.request_id, now_s)
        d = self._decode_index[state.decode_instance or ""]
        senders = started.group or (p,)  # each CPP member streams its own layers' KV
        state.pending_kv = len(senders)
        for sender in senders:
            self._start_flow(now_s, _KV, state.index, sender, self.config.num_prefill + d,
                             state.arrival.input_len * self.kv_per_token / len(senders))
        return self._flow_event()

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
            evicted = self.store.insert(state.arrival.block_keys)
            self.conductor.on_blocks_stored(STORE, state.arrival.block_keys)
            if evicted:
                self.conductor.on_blocks_removed(STORE, evicted)
        events = self._prefill_started(p, now_s, nxt)
        admitted = self.conductor.admit_decode(state.request_id, now_s)
        if isinstance(admitted, Rejection):  # checked after prefill: the prefill was spent for nothing
            state.rejected = "tbt_slo_after_prefill"
            return events
        if admitted is not None and self.config.decode_node_guard:
            admitted = self._guard_decode(state, admitted, now_s)
            if admitted is None:
                state.rejected = "tbt_slo_after_prefill"
                return events
        if admitted is not None and admitted.instance_id != state.decode_instance:
            # Chosen again at the end of the prefill: the KV goes to the new decode node.
            state.decode_instance = admitted.instance_id
            self._restream_kv(state, p, now_s)
            events.extend(self._flow_event())
        state.first_token_s = now_s
        if state.kv_arrived:
            events.extend(self._to_decode(state, now_s))
        return events

    def _guard_decode(self, state: RequestState, admitted: DecodeEstimate,
                      now_s: float) -> DecodeEstimate | None:
        """`decode_node_guard`: the decode node the Conductor chose must start the request at once
        (its reserved KV, that of the requests already sent to it and this one's within its
        memory), else the node with the most room that can, else None (rejected after prefill:
        the Conductor forgets it). A request that waited for memory would hold its first decode
        gap for the wait, over the TBT SLO."""
        need = state.arrival.input_len + state.arrival.output_len
        room = [self.kv_capacity_tokens - inst.reserved_tokens - self._committed[d]
                for d, inst in enumerate(self.decodes)]
        chosen = self._decode_index[admitted.instance_id]
        d = chosen if room[chosen] >= need else max(range(len(room)), key=room.__getitem__)
        if room[d] < need:
            self.conductor.on_request_aborted(state.request_id)
            return None
        self._committed[d] += need
        self._commit_of[state.index] = (d, need)
        if d == chosen:
            return admitted
        self.conductor.move_decode(state.request_id, self.decode_ids[d], now_s)
        return DecodeEstimate(self.decode_ids[d], admitted.batch_size, admitted.context_tokens,
                              admitted.tbt_s)

    def _uncommit(self, req: int) -> None:
        commit = self._commit_of.pop(req, None)
        if commit is not None:
            self._committed[commit[0]] -= commit[1]

    def _to_decode(self, state: RequestState, now_s: float) -> list[Event]:
        if state.arrival.output_len <= 1:  # the prefill's token was the only one
            self._uncommit(state.index)
            state.finish_s = now_s
            self.conductor.on_decode_finished(state.decode_instance or "", state.request_id, now_s)
            return []
        d = self._decode_index[state.decode_instance or ""]
        a = state.arrival
        seq = Seq(state.index, a.input_len, a.output_len - 1, a.input_len + a.output_len,
                  state.first_token_s or now_s, state.gaps)
        event = self.decodes[d].add(now_s, seq)
        self._report_joined(d, now_s)
        return [] if event is None else [event]

    def _report_joined(self, d: int, now_s: float) -> None:
        """Tell the Conductor which requests started decoding on d (had room for their KV)."""
        for seq in self.decodes[d].take_joined():
            state = self.states[seq.req]
            self._uncommit(seq.req)
            state.decode_join_s = now_s
            self.conductor.on_decode_joined(self.decode_ids[d], state.request_id, now_s)
        if self.config.decode_node_guard:
            self.conductor.on_decode_kv(self.decode_ids[d], self.decodes[d].reserved_tokens)

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
        for seq in finished:
            state = self.states[seq.req]
            state.finish_s = now_s
            self.conductor.on_decode_finished(name, state.request_id, now_s)
        if self.config.decode_node_guard and not self.config.colocated:
            self.conductor.on_decode_kv(name, instance.reserved_tokens)
        return [] if nxt is None else [nxt]

    # ---- network -----------------------------------------------------------------------------

    def _start_flow(self, now_s: float, kind: int, req: int, src: int, dst: int,
                    num_bytes: float, epoch: int = 0) -> None:
        flow_id = self._next_flow
        self._next_flow += 1
        self._flows[flow_id] = (kind, req, epoch)
        self.network.start_flow(now_s, flow_id, src, dst, num_bytes)

    def _flow_event(self) -> list[Event]:
        finish_s = self.network.next_finish_s()
        if finish_s is None:
            return []
        return [Event(finish_s, EventKind.FLOW_DONE, 0, self.network.version)]

    def _on_flow_done(self, event: Event) -> list[Event]:
        if event.token != self.network.version:
            return []  # the flows changed since this was scheduled
        events: list[Event] = []
        for flow_id in self.network.advance(event.time_s):
            kind, req, epoch = self._flows.pop(flow_id)
            state = self.states[req]
            if kind == _KV and epoch != state.kv_epoch:
                continue  # streamed toward a decode node no longer chosen
            if kind == _FETCH:
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
        events.extend(self._flow_event())
        return events

    # ---- caches ------------------------------------------------------------------------------

    def _cache_insert(self, p: int, keys: Sequence[int]) -> None:
        evicted = self.prefills[p].cache.insert(keys)
        name = self.prefill_ids[p]
        self.conductor.on_blocks_stored(name, keys)
        if evicted:
            self.conductor.on_blocks_removed(name, evicted)

    # ---- colocated ---------------------------------------------------------------------------

    def _place_colocated(self, state: RequestState, now_s: float) -> list[Event]:
        i = self._prefill_index[state.prefill_instance or ""]
        a = state.arrival
        cache = self.hbm_caches[i]
        matched = cache.match_len(a.block_keys)
        cache.touch(a.block_keys[:matched])
        state.prefix_len = min(matched * self.config.block_size, a.input_len - 1)
        seq = Seq(state.index, a.input_len, max(0, a.output_len - 1), a.input_len + a.output_len,
                  now_s, state.gaps, prefill_done_len=state.prefix_len,
                  prefix_len=state.prefix_len)
        event = self.decodes[i].add_prefill(now_s, seq)
        return [] if event is None else [event]

    def _hbm_insert(self, i: int, keys: Sequence[int]) -> None:
        """Cache a prompt's blocks in the free HBM of colocated instance i (LRU)."""
        if not self.config.prefix_cache:
            return
        instance, cache, name = self.decodes[i], self.hbm_caches[i], self.prefill_ids[i]
        free = max(0, self.kv_capacity_tokens - instance.reserved_tokens)
        evicted = cache.resize(free // self.config.block_size)
        evicted += cache.insert(keys)
        self.conductor.on_blocks_stored(name, keys)
        if evicted:
            self.conductor.on_blocks_removed(name, evicted)

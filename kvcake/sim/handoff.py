"""The hand-off to decode: a request's KV stream from its prefill node(s) to its decode node, and
the decode node's final choice when the prefill ends.

    prefill starts  `stream`: each sender (every member of a CPP group, for its own layers)
                    streams its share of the KV to the decode node chosen at arrival
    prefill ends    `at_prefill_end`: the Conductor's `admit_decode` (a decode check after
                    prefill) may reject the request, its prefill spent for nothing, or choose the
                    node again; with `decode_node_guard` the node must start it at once, else the
                    one with the most room that can, else a rejection; with
                    `decode_reselect_at_handoff` (the arrival decision is final) a full node hands
                    the request to one with room; with `decode_check_keeps_node` the check asks
                    only the node chosen at arrival (no other is tried). A request whose node changes has its KV
                    streamed again under a new KV epoch (flows in flight finish, no longer count).

The guard (guard.py) books each request's KV at its node until the request joins the batch there:
the prompt plus the output length the node was told (`told_output_len`, the same the Conductor is
told), never the request's true output length, which no live node knows at hand-off.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcake.conductor import Conductor, DecodeEstimate, Rejection
from kvcake.sim.config import SimConfig
from kvcake.sim.decode import DecodeInstance
from kvcake.sim.events import Event
from kvcake.sim.guard import DecodeNodeGuard
from kvcake.sim.records import RequestState
from kvcake.sim.transfers import Transfer, TransferKind, Transfers

REJECTED_AFTER_PREFILL = "tbt_slo_after_prefill"  # the reason a request is recorded with


class DecodeHandoff:
    """Which decode node takes each prefilled request, and the KV streams that go there."""

    def __init__(self, config: SimConfig, conductor: Conductor, transfers: Transfers,
                 guard: DecodeNodeGuard, decode_ids: Sequence[str], kv_per_token: int) -> None:
        """`config.predicted_output_len` is the told output length, resolved (not None)."""
        self.config, self.conductor, self.transfers = config, conductor, transfers
        self.guard = guard
        self.decode_ids = list(decode_ids)
        self._decode_index = {name: j for j, name in enumerate(decode_ids)}
        self.kv_per_token = kv_per_token
        if config.predicted_output_len is None:
            raise ValueError("DecodeHandoff needs the told output length resolved: set "
                             "config.predicted_output_len (topology.told_output_len)")
        # what the decode node is told of each request's output (never its true length)
        self.told_output_len: int = config.predicted_output_len

    def stream(self, state: RequestState, senders: tuple[int, ...], now_s: float) -> list[Event]:
        """Start the request's KV flows (an equal share from each prefill node in `senders`) to
        its decode node, under its current KV epoch; return the network's next FLOW_DONE."""
        d = self._decode_index[state.decode_instance or ""]
        state.pending_kv = len(senders)
        kv = Transfer(TransferKind.KV, state.index, state.kv_epoch)
        for sender in senders:
            self.transfers.start(now_s, kv, sender, self.config.num_prefill + d,
                                 state.arrival.input_len * self.kv_per_token / len(senders))
        return self.transfers.next_event()

    def at_prefill_end(self, state: RequestState, p: int, now_s: float,
                       decodes: Sequence[DecodeInstance]) -> list[Event]:
        """The request's prefill on p just ended: reject it (`state.rejected` set) or settle its
        decode node, streaming its KV again if the node changed."""
        admitted = self.conductor.admit_decode(state.request_id, now_s)
        if isinstance(admitted, Rejection):  # checked after prefill: the prefill was spent for nothing
            state.rejected = REJECTED_AFTER_PREFILL
            return []
        if admitted is not None and self.config.decode_node_guard:
            admitted = self._guard_decode(state, admitted, now_s, decodes)
            if admitted is None:
                state.rejected = REJECTED_AFTER_PREFILL
                return []
        if admitted is None and self.config.decode_reselect_at_handoff:
            return self._reselect_decode(state, p, now_s, decodes)
        if admitted is not None and admitted.instance_id != state.decode_instance:
            # Chosen again at the end of the prefill: the KV goes to the new decode node.
            state.decode_instance = admitted.instance_id
            return self._restream_kv(state, p, now_s)
        return []

    def _reselect_decode(self, state: RequestState, p: int, now_s: float,
                         decodes: Sequence[DecodeInstance]) -> list[Event]:
        """`decode_reselect_at_handoff`: the arrival decision stands, the node may change (the
        guard's `hand_off`); a moved request's booking and KV stream follow it."""
        a = state.arrival
        chosen = self._decode_index[state.decode_instance or ""]
        d = self.guard.hand_off(state.index, a.input_len + self.told_output_len, chosen, decodes)
        if d == chosen:
            return []
        self.conductor.move_decode(state.request_id, self.decode_ids[d], now_s)
        state.decode_instance = self.decode_ids[d]
        return self._restream_kv(state, p, now_s)

    def _guard_decode(self, state: RequestState, admitted: DecodeEstimate, now_s: float,
                      decodes: Sequence[DecodeInstance]) -> DecodeEstimate | None:
        """`decode_node_guard` (guard.py): the decode node the Conductor chose if it can start
        the request at once, else the one with the most room that can (the Conductor moves the
        booking), else None (rejected after prefill: the Conductor forgets it)."""
        chosen = self._decode_index[admitted.instance_id]
        d = self.guard.place(state.index, state.arrival.input_len + self.told_output_len,
                             chosen, decodes, self.config.decode_check_keeps_node)
        if d is None:
            self.conductor.on_request_aborted(state.request_id)
            return None
        if d == chosen:
            return admitted
        self.conductor.move_decode(state.request_id, self.decode_ids[d], now_s)
        return DecodeEstimate(self.decode_ids[d], admitted.batch_size, admitted.context_tokens,
                              admitted.tbt_s)

    def _restream_kv(self, state: RequestState, p: int, now_s: float) -> list[Event]:
        """The KV streamed toward the first decode choice is sent to the new one instead (its
        flows already in flight still finish; they no longer count)."""
        state.kv_arrived = False
        state.kv_epoch += 1
        return self.stream(state, state.prefill_group or (p,), now_s)

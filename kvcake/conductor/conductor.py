"""The Conductor: KVCache-centric global scheduling (seed section IX, Algorithm 1) and baselines.

Lifecycle of one request, as the caller (simulator or live frontend) drives it:

    decision = conductor.schedule(req, now_s)        # Placement | Rejection, books the placement
    if Placement with fetch:  ... on_transfer_done(request_id, now_s)
                              on_transfer_measured(num_bytes, seconds)   # the bandwidth estimate
                              on_blocks_stored(prefill_id, fetch.keys)   # the new replica
    on_prefill_started(prefill_id, request_id, now_s)
    on_prefill_finished(prefill_id, request_id, now_s)
    on_blocks_stored(prefill_id, keys)  /  on_blocks_removed(holder, keys)   # cache changes
    on_decode_joined(decode_id, request_id, now_s)
    on_decode_finished(decode_id, request_id, now_s)
    on_request_aborted(request_id)                   # at any point: forget its bookings

The fetch threshold: Algorithm 1 fetches when best_len / local_len > threshold. We evaluate it
cross-multiplied, best_len > threshold * local_len, which is the same for local_len > 0 and
defines local_len = 0: any remote prefix is fetched (the ratio is +inf), and 0 / 0 (nobody holds
anything) fetches nothing. Reading 0 as "no ratio, recompute" would forbid exactly the fetches
to cold instances that spread hot prefixes (hotspot migration) in the first place.

Decision cost (target: p99 <= 1 ms with 64 prefill + 64 decode instances, 256-block prompts):
one C-level pass over the request's keys in the index; one prefill plan per distinct local prefix
length rather than per instance; model answers remembered (the models are pure); a decode
instance's forecast and estimate reused until its book changes or the forecast time crosses one
of its finish or join times; the prefill breakdown kept compact until someone reads it
(`LazyPrefillCandidates`), so a placement kept for a request's lifetime holds a few objects for
the garbage collector, not one per instance. `tests/conductor/test_golden.py` pins every decision
bit for bit against a record made before these changes.

Algorithm 1 reads here: `schedule` (least estimated TTFT, decode choice, early rejection) and
`_plan_prefill` (fetch past `kvcache_balancing_threshold`, replicating hot prefixes, or
recompute). Its nouns live beside it: `pools.py`, `prefill_plan.py`, `decode_choice.py`,
`admission.py` (early rejection), `transfers.py` (fetches), `placements.py` (bookings).

Pure: no I/O, no clock (`now_s` is an argument), no threads.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from itertools import repeat

from kvcake.conductor.admission import AdmissionControl
from kvcake.conductor.bandwidth import BandwidthEstimator
from kvcake.conductor.config import ConductorConfig, Policy
from kvcake.conductor.decision import (
    Decision,
    DecodeEstimate,
    LazyPrefillCandidates,
    Placement,
    Rejection,
    ScheduleRequest,
)
from kvcake.conductor.decode_choice import DecodeChoice
from kvcake.conductor.index import GlobalIndex, PrefixMatch
from kvcake.conductor.load import DecodeLoad, PrefillQueue
from kvcake.conductor.pending import PendingBlocks
from kvcake.conductor.placements import Placements
from kvcake.conductor.pools import InstancePools
from kvcake.conductor.predictor import DecodeModel, PrefillModel
from kvcake.conductor.prefill_plan import Plan, PrefillTimes, at_speed, turn_down_slow_fetches
from kvcake.conductor.transfers import Transfers


class Conductor:
    """Places requests on (prefill, decode) instance pairs, or rejects them.

    prefill_ids / decode_ids: the instance pools, in a fixed order that breaks ties. With
    Policy.COLOCATED every instance prefills and decodes: pass the same ids twice (or no
    decode_ids). kv_bytes_per_token sizes planned fetches.
    """

    def __init__(
        self,
        config: ConductorConfig,
        prefill_ids: Sequence[str],
        decode_ids: Sequence[str],
        prefill_model: PrefillModel,
        decode_model: DecodeModel,
        kv_bytes_per_token: int,
    ) -> None:
        if config.policy is Policy.COLOCATED:
            if decode_ids and list(decode_ids) != list(prefill_ids):
                raise ValueError("policy colocated: decode_ids must equal prefill_ids (or be empty)")
            decode_ids = prefill_ids
        self.config = config
        self._transfers = Transfers(config, kv_bytes_per_token)
        self.bandwidth: BandwidthEstimator = self._transfers.bandwidth
        self.index = GlobalIndex()  # blocks that exist: computed, fetched or stored
        self.pending = PendingBlocks()  # blocks placed but not computed yet: local, not fetchable
        self._decode_model = decode_model
        self._rng = random.Random(config.seed)
        self._pools = InstancePools(config.cpp_nodes, config.cpp_min_tokens)
        # the live books, shared (the same dicts) with the nouns below
        self._queues, self._decodes = self._pools.queues, self._pools.decodes
        self._decode_choice = DecodeChoice(config, self._decodes, decode_model)
        self._admission = AdmissionControl(config, self._decodes)
        self._placements = Placements(self._pools, self.pending, self._transfers,
                                      config.index_on_placement, config.prefill_speed_weight)
        self._prefill_times = PrefillTimes(prefill_model, config.cpp_nodes,
                                           config.cpp_chunk_tokens)
        for instance_id in prefill_ids:
            self.add_prefill_instance(instance_id)
        for instance_id in decode_ids:
            self.add_decode_instance(instance_id)

    # ---- pools -------------------------------------------------------------------------------

    @property
    def prefill_ids(self) -> list[str]:
        return list(self._queues)

    @property
    def decode_ids(self) -> list[str]:
        return list(self._decodes)

    def add_prefill_instance(self, instance_id: str, cpp_member: int | None = None) -> None:
        """`cpp_member`: the instance is that stage (0-based) of a dedicated CPP group: it holds
        only a slice of the layers, so it prefills only as part of its group (the group forms
        once stages 0..cpp_nodes-1 are all registered), never alone."""
        self._pools.add_prefill(instance_id, cpp_member)
        self.index.add_holder(instance_id)

    def add_decode_instance(self, instance_id: str) -> None:
        self._pools.add_decode(instance_id)

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance (it died or was drained), its queue and its cached blocks."""
        self._pools.remove(instance_id)
        self._decode_choice.forget(instance_id)
        self.index.remove_holder(instance_id)
        self.pending.remove_holder(instance_id)

    @property
    def cpp_groups(self) -> tuple[tuple[str, ...], ...]:
        """The CPP groups (consecutive runs of `cpp_nodes` prefill instances); () when off."""
        return self._pools.cpp_groups

    def set_transfer_bandwidth(self, bytes_per_s: float) -> None:
        """Set the KVCache loading speed; later measured transfers update it from there."""
        self._transfers.set_bandwidth(bytes_per_s)

    @property
    def transfer_bandwidth(self) -> float:
        """The loading speed fetches are planned at (bytes/s)."""
        return self._transfers.bytes_per_s

    def on_transfer_measured(self, num_bytes: int, seconds: float) -> bool:
        """A KVCache fetch moved `num_bytes` in `seconds` (measured by the caller): fold it into
        the bandwidth estimate later fetches are planned at. False: too small to count."""
        return self._transfers.observe(num_bytes, seconds)

    def queue_s(self, instance_id: str, now_s: float) -> float:
        return self._pools.queue(instance_id).queue_s(now_s)

    def prefill_queue(self, instance_id: str) -> PrefillQueue:
        """The live book of one prefill instance (for inspection, or seeding a cluster view)."""
        return self._pools.queue(instance_id)

    def decode_load(self, instance_id: str) -> DecodeLoad:
        """The live book of one decode instance."""
        return self._pools.decode(instance_id)

    def inflight_bytes(self, source: str) -> int:
        """Bytes of planned fetches from `source` not yet reported done."""
        return self._transfers.inflight_bytes.get(source, 0)

    # ---- scheduling: Algorithm 1 -------------------------------------------------------------

    def schedule(self, req: ScheduleRequest, now_s: float) -> Decision:
        """Place `req` or reject it; a placement is booked at once (queue, decode, fetch, index)."""
        if req.request_id in self._placements.placed:
            raise ValueError(f"request {req.request_id!r} is already placed")
        if not self._decodes or not (self._pools.prefill_pool or self._uses_cpp(req)):
            return self._admission.no_instance(req.request_id)
        match = self.index.match(req.block_keys)
        local_blocks = self._local_blocks(req, match)
        source = self._fetch_source(match)
        group: tuple[str, ...] = ()
        if self._uses_cpp(req):
            candidates, ttfts, local_blocks = self._estimate_cpp(req, match, local_blocks, source,
                                                                 now_s)
            chosen_at = min(range(len(ttfts)), key=ttfts.__getitem__)
            group = self._pools.cpp_groups[chosen_at]
        else:
            candidates, ttfts = self._estimate_prefills(req, match, local_blocks, source, now_s)
            chosen_at = self._choose_prefill(candidates, ttfts)
        chosen = candidates[chosen_at]
        ttft_s = chosen.ttft_s
        decode_candidates = self._decode_choice.estimate(req, chosen.instance_id, now_s, ttft_s)
        best_decode = self._decode_choice.choose(decode_candidates)
        rejection = self._admission.at_arrival(req, now_s, ttft_s, best_decode, candidates,
                                               decode_candidates)
        if rejection is not None:
            return rejection
        fetch = self._transfers.plan(req, chosen, local_blocks[chosen_at], source)
        self._placements.book(req, now_s, chosen, best_decode.instance_id, fetch, group)
        placement = Placement._with_lazy_candidates(
            candidates, request_id=req.request_id, prefill_id=chosen.instance_id,
            decode_id=best_decode.instance_id, prefix_len=chosen.prefix_len, fetch=fetch,
            predicted_ttft_s=ttft_s, predicted_tbt_s=best_decode.tbt_s,
            decode_candidates=decode_candidates, prefill_group=group)
        return placement

    def _reuse_len(self, req: ScheduleRequest, num_blocks: int) -> int:
        # The last prompt token is always computed: its logits give the first output token.
        return min(num_blocks * req.block_size, req.prompt_len - 1)

    def _local_blocks(self, req: ScheduleRequest, match: PrefixMatch) -> list[int]:
        """Prefix blocks each prefill instance (pool order) will have when this request runs
        there: what it holds, or what requests placed before will have computed (pending)."""
        pool = self._pools.prefill_pool
        by_holder = match.blocks_by_holder
        blocks = list(map(by_holder.get, pool, repeat(0))) if by_holder else [0] * len(pool)
        pending = self.pending.match(req.block_keys)
        if pending is not None and pending.blocks_by_holder:
            blocks = list(map(max, blocks, map(pending.blocks_by_holder.get, pool, repeat(0))))
        return blocks

    def _fetch_source(self, match: PrefixMatch) -> str | None:
        """Where a fetch reads from (`Transfers.source`: the least loaded longest-prefix holder)."""
        return self._transfers.source(match)

    def _estimate_prefills(self, req: ScheduleRequest, match: PrefixMatch, blocks: list[int],
                           source: str | None,
                           now_s: float) -> tuple[LazyPrefillCandidates, list[float]]:
        """Algorithm 1, lines 4-13, for every prefill instance (baselines: recompute only).

        `blocks`: each instance's local prefix blocks (`_local_blocks`); `source`: where a fetch
        reads from (`_fetch_source`). Returns the candidates, in compact form, and their `ttft_s`
        summed in the same order as `PrefillEstimate.ttft_s` (so the very same floats) for the
        choice. Instances that hold the same number of prefix blocks differ only in their queue:
        their plan is made once.
        """
        pool = self._pools.prefill_pool
        predicted: dict[int, float] = {}  # prefix_len -> prefill seconds; few distinct per request
        plan_of = {n: self._plan_prefill(req, match, n, source, predicted)
                   for n in dict.fromkeys(blocks)}
        plans = list(map(plan_of.__getitem__, blocks))
        books = list(map(self._queues.__getitem__, pool) if self._pools.cpp_members
                     else self._queues.values())
        queues = list(map(PrefillQueue.queue_s, books, repeat(now_s)))
        if self.config.prefill_speed_weight:  # each instance's prefill at its learned speed
            plans = [at_speed(plan, book.speed) for plan, book in zip(plans, books, strict=True)]
        ttfts = [plan[2] + queue_s + plan[3] for plan, queue_s in zip(plans, queues, strict=True)]
        if self.config.fetch_only_if_faster:
            turn_down_slow_fetches(plans, queues, ttfts)
        return LazyPrefillCandidates(pool, tuple(plans), tuple(queues)), ttfts

    # ---- chunked pipeline parallelism ---------------------------------------------------------

    def _uses_cpp(self, req: ScheduleRequest) -> bool:
        threshold = self.config.cpp_min_tokens
        return (threshold is not None and req.prompt_len >= threshold
                and bool(self._pools.cpp_groups))

    def _estimate_cpp(self, req: ScheduleRequest, match: PrefixMatch, blocks: list[int],
                      source: str | None,
                      now_s: float) -> tuple[LazyPrefillCandidates, list[float], list[int]]:
        """Algorithm 1 over the CPP groups instead of the instances: a group reuses the prefix
        all its members hold, waits for its busiest member, and prefills in
        `pipelined_prefill_s`. Candidates are named by each group's first instance; returns
        them, their TTFTs and each group's local prefix blocks."""
        pools = self._pools
        group_blocks, group_queues = pools.group_blocks(blocks), pools.group_queue_s(now_s)
        predicted: dict[int, float] = {}  # prefix_len -> pipelined prefill seconds
        # Dedicated members hold no prefix (a stage holds a slice of each block): each reads its
        # layers of the fetched prefix, so the group fetches it and pipelines the new tokens.
        plans = [self._plan_prefill(req, match, n, source, predicted, pipelined=True)
                 for n in group_blocks]
        ttfts = [plan[2] + queue_s + plan[3] for plan, queue_s in zip(plans, group_queues,
                                                                     strict=True)]
        if self.config.fetch_only_if_faster:
            turn_down_slow_fetches(plans, group_queues, ttfts)
        leads = tuple(group[0] for group in pools.cpp_groups)
        return LazyPrefillCandidates(leads, tuple(plans), tuple(group_queues)), ttfts, group_blocks

    def _plan_prefill(self, req: ScheduleRequest, match: PrefixMatch, num_blocks: int,
                      source: str | None, predicted: dict[int, float],
                      pipelined: bool = False) -> Plan:
        """Fetch or recompute, for an instance holding `num_blocks` prefix blocks (Algorithm 1)."""
        cfg = self.config
        local_len = self._reuse_len(req, num_blocks)
        best_len = self._reuse_len(req, match.best_blocks)
        if (cfg.policy is Policy.GLOBAL_CACHE and source is not None
                and best_len > cfg.kvcache_balancing_threshold * local_len):
            transfer_s = self._transfers.transfer_s(source, local_len, best_len)
            recompute_s = (self._prefill_s(req, local_len, predicted, pipelined)
                           if cfg.fetch_only_if_faster else None)
            return (local_len, best_len, transfer_s,
                    self._prefill_s(req, best_len, predicted, pipelined), recompute_s)
        return local_len, local_len, 0.0, self._prefill_s(req, local_len, predicted, pipelined), None

    def _prefill_s(self, req: ScheduleRequest, prefix_len: int, predicted: dict[int, float],
                   pipelined: bool = False) -> float:
        """`predicted`: this decision's answers by prefix length (few distinct per request)."""
        seconds = predicted.get(prefix_len)
        if seconds is None:
            seconds = predicted[prefix_len] = self._prefill_times.seconds(req.prompt_len,
                                                                         prefix_len, pipelined)
        return seconds

    def _choose_prefill(self, candidates: LazyPrefillCandidates, ttfts: list[float]) -> int:
        """The index of the chosen candidate."""
        policy = self.config.policy
        if policy is Policy.RANDOM:
            return self._rng.randrange(len(candidates))
        # min() keeps the first of equal keys: ties go to pool order.
        if policy is Policy.LOAD_BALANCE:
            return min(range(len(ttfts)), key=candidates.queue_s.__getitem__)
        best = min(range(len(ttfts)), key=ttfts.__getitem__)
        if policy is Policy.COLOCATED:
            # Every instance also decodes: among equal TTFTs (idle queues, no cached prefix)
            # the one decoding the fewest requests, or an idle cluster would send every
            # request to the first instance and stall its decodes with every prefill.
            decodes, ids = self._decodes, candidates.instance_ids
            ties = [i for i, ttft in enumerate(ttfts) if ttft == ttfts[best]]
            if len(ties) > 1:
                return min(ties, key=lambda i: decodes[ids[i]].num_booked)
        return best


    # ---- reports from the caller --------------------------------------------------------------

    def on_prefill_started(self, instance_id: str, request_id: str, now_s: float) -> None:
        """The prefill began (a CPP request: on its group; report it for any member)."""
        self._placements.prefill_started(instance_id, request_id, now_s)

    def on_prefill_finished(self, instance_id: str, request_id: str, now_s: float) -> None:
        """The prefill ended; its blocks stop being pending (report them with `on_blocks_stored`,
        for every member of a CPP group)."""
        self._placements.prefill_finished(instance_id, request_id, now_s)

    def on_transfer_done(self, request_id: str, now_s: float) -> None:
        """The planned fetch of `request_id` completed (or failed): its bytes no longer queue."""
        self._transfers.done(request_id)

    def on_blocks_stored(self, holder: str, keys: Sequence[Hashable]) -> None:
        """`holder` (a prefill instance or a store tier such as "store") now has `keys`."""
        self.index.add(holder, keys)

    def on_blocks_removed(self, holder: str, keys: Sequence[Hashable]) -> None:
        self.index.remove(holder, keys)

    def admit_decode(self, request_id: str,
                     now_s: float) -> DecodeEstimate | Rejection | None:
        """Admission DECODE_AFTER_PREFILL (or SLO / EARLY with `decode_check_after_prefill`): the
        prefill of `request_id` is done; where may it decode?

        The decode instance is chosen again now, by the least predicted TBT with the request
        added (its booking moves there): that instance's estimate (`decode_check_keeps_node`:
        only the instance chosen at arrival is asked). A Rejection (the request
        forgotten, as `on_request_aborted`) when even that TBT exceeds the SLO: the prefill was
        spent for nothing. Under every other admission mode the decision was made at arrival:
        None."""
        if not self._admission.checks_decode_after_prefill:
            return None
        placed = self._placements.placed.get(request_id)
        expected = self._placements.take_decode(request_id)  # counted below as joining now
        if expected is None or placed is None:
            return None
        estimates = self._decode_choice.estimate_now(*expected, now_s)
        if self.config.decode_check_keeps_node:  # only the instance its KV was streamed to
            best = next(e for e in estimates if e.instance_id == placed[1])
        else:
            best = self._decode_choice.choose(estimates)
        rejection = self._admission.after_prefill(request_id, best, now_s, estimates)
        if rejection is None:
            self._placements.rebook_decode(request_id, best.instance_id, now_s, expected)
            return best
        self.on_request_aborted(request_id)
        return rejection

    def move_decode(self, request_id: str, instance_id: str, now_s: float) -> None:
        """The request admitted after its prefill goes to `instance_id` instead (its decode node
        had no room for it): its booking, expected to join now, moves there."""
        self._placements.move_decode(request_id, instance_id, now_s)

    def on_decode_joined(self, instance_id: str, request_id: str, now_s: float) -> None:
        self._pools.decode(instance_id).join(request_id, now_s,
                                             self._decode_model.decode_step_time_s,
                                             self.config.uniform_decode_s)

    def on_decode_kv(self, instance_id: str, reserved_tokens: int) -> None:
        """The decode instance reports the KV tokens it holds reserved now (its own books: a
        request's prompt plus its output). The KV checks count what it holds beyond this
        Conductor's book (`DecodeLoad.kv_undercount`)."""
        if reserved_tokens < 0:
            raise ValueError(f"reserved_tokens must be >= 0, got {reserved_tokens}")
        self._pools.decode(instance_id).reported_kv_tokens = reserved_tokens

    def on_decode_finished(self, instance_id: str, request_id: str, now_s: float) -> None:
        self._placements.decode_finished(instance_id, request_id)

    def on_request_aborted(self, request_id: str) -> None:
        """Forget every booking of `request_id` (client gone, instance failed)."""
        self._placements.abort(request_id)

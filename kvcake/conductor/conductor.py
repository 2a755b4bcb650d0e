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

Pure: no I/O, no clock (`now_s` is an argument), no threads.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Sequence
from itertools import repeat
from operator import itemgetter

from kvcake.conductor.bandwidth import BandwidthEstimator
from kvcake.conductor.config import Admission, ConductorConfig, Policy
from kvcake.conductor.cpp import cpp_groups, pipelined_prefill_s
from kvcake.conductor.decision import (
    Decision,
    DecodeEstimate,
    FetchPlan,
    LazyPrefillCandidates,
    Placement,
    PrefillEstimate,
    Rejection,
    RejectReason,
    ScheduleRequest,
)
from kvcake.conductor.index import GlobalIndex, PrefixMatch
from kvcake.conductor.load import DecodeLoad, PrefillQueue
from kvcake.conductor.pending import PendingBlocks
from kvcake.conductor.predictor import DecodeModel, PrefillModel

# (local_len, prefix_len, transfer_s, prefill_s, recompute_s): one instance's prefill plan;
# recompute_s is the local alternative when fetch_only_if_faster must weigh it.
_Plan = tuple[int, int, float, float, float | None]
_TBT_S = itemgetter(3)  # DecodeEstimate.tbt_s
_MAX_PREDICTIONS = 1 << 16  # remembered prefill predictions (a few MB at most)


def _turn_down_slow_fetches(plans: list[_Plan], queues: list[float], ttfts: list[float]) -> None:
    """fetch_only_if_faster: where recomputing locally finishes no later than fetching, plan that."""
    local_plans: dict[int, _Plan] = {}  # local_len -> the recompute plan
    for i, (plan, queue_s) in enumerate(zip(plans, queues, strict=True)):
        recompute_s = plan[4]
        if recompute_s is not None and queue_s + recompute_s <= ttfts[i]:
            local_len = plan[0]
            local = local_plans.get(local_len)
            if local is None:
                local = local_plans[local_len] = (local_len, local_len, 0.0, recompute_s, None)
            plans[i] = local
            ttfts[i] = 0.0 + queue_s + recompute_s


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
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        self.config = config
        self.index = GlobalIndex()  # blocks that exist: computed, fetched or stored
        self.pending = PendingBlocks()  # blocks placed but not computed yet: local, not fetchable
        self._prefill_model = prefill_model
        self._decode_model = decode_model
        self._kv_bytes_per_token = kv_bytes_per_token
        self._bandwidth = config.transfer_bandwidth_bytes_per_s
        self.bandwidth = BandwidthEstimator(config.transfer_bandwidth_bytes_per_s,
                                            config.measured_bandwidth_weight,
                                            config.min_measured_bytes)
        self._rng = random.Random(config.seed)
        self._queues: dict[str, PrefillQueue] = {}
        self._decodes: dict[str, DecodeLoad] = {}
        self._inflight_bytes: dict[str, int] = {}  # fetch source -> bytes planned, not done
        self._transfers: dict[str, tuple[str, int]] = {}  # request -> (source, bytes)
        self._placed: dict[str, tuple[str, str]] = {}  # request -> (prefill_id, decode_id)
        self._last_decode_estimates: dict[str, DecodeEstimate] = {}  # instance -> its last one
        self._prefill_pool: tuple[str, ...] = ()  # the keys of _queues, shared by decisions
        self._cpp_groups: tuple[tuple[str, ...], ...] = ()  # CPP: the pool cut into groups
        self._group_of: dict[str, tuple[str, ...]] = {}  # CPP request -> its group
        # CPP members (layer slices, never placed alone) -> position in their group's pipeline
        self._cpp_members: dict[str, int] = {}
        self._predicted_prefill_s: dict[tuple[int, int], float] = {}  # (prompt, prefix) -> s
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
        if instance_id in self._queues:
            raise ValueError(f"prefill instance {instance_id!r} is already registered")
        if cpp_member is not None:
            if not 0 <= cpp_member < self.config.cpp_nodes:
                raise ValueError(f"cpp_member: must be in [0, {self.config.cpp_nodes}), got "
                                 f"{cpp_member}")
            self._cpp_members[instance_id] = cpp_member
        self._queues[instance_id] = PrefillQueue()
        self._pool_changed()
        self.index.add_holder(instance_id)

    def add_decode_instance(self, instance_id: str) -> None:
        if instance_id in self._decodes:
            raise ValueError(f"decode instance {instance_id!r} is already registered")
        self._decodes[instance_id] = DecodeLoad()

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance (it died or was drained), its queue and its cached blocks."""
        self._queues.pop(instance_id, None)
        self._cpp_members.pop(instance_id, None)
        self._pool_changed()
        self._decodes.pop(instance_id, None)
        self._last_decode_estimates.pop(instance_id, None)
        self.index.remove_holder(instance_id)
        self.pending.remove_holder(instance_id)

    def _pool_changed(self) -> None:
        members = self._cpp_members
        self._prefill_pool = tuple(i for i in self._queues if i not in members) if members \
            else tuple(self._queues)
        if self.config.cpp_min_tokens is None:
            return
        if not members:
            self._cpp_groups = cpp_groups(self._prefill_pool, self.config.cpp_nodes)
            return
        stages = sorted(members, key=members.__getitem__)
        complete = [members[m] for m in stages] == list(range(self.config.cpp_nodes))
        self._cpp_groups = (tuple(stages),) if complete else ()

    @property
    def cpp_groups(self) -> tuple[tuple[str, ...], ...]:
        """The CPP groups (consecutive runs of `cpp_nodes` prefill instances); () when off."""
        return self._cpp_groups

    def set_transfer_bandwidth(self, bytes_per_s: float) -> None:
        """Set the KVCache loading speed; later measured transfers update it from there."""
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.bandwidth.reset(bytes_per_s)
        self._bandwidth = bytes_per_s

    @property
    def transfer_bandwidth(self) -> float:
        """The loading speed fetches are planned at (bytes/s)."""
        return self._bandwidth

    def on_transfer_measured(self, num_bytes: int, seconds: float) -> bool:
        """A KVCache fetch moved `num_bytes` in `seconds` (measured by the caller): fold it into
        the bandwidth estimate later fetches are planned at. False: too small to count."""
        if not self.bandwidth.observe(num_bytes, seconds):
            return False
        self._bandwidth = self.bandwidth.bytes_per_s
        return True

    def queue_s(self, instance_id: str, now_s: float) -> float:
        return self._queue(instance_id).queue_s(now_s)

    def prefill_queue(self, instance_id: str) -> PrefillQueue:
        """The live book of one prefill instance (for inspection, or seeding a cluster view)."""
        return self._queue(instance_id)

    def decode_load(self, instance_id: str) -> DecodeLoad:
        """The live book of one decode instance."""
        return self._decode(instance_id)

    def inflight_bytes(self, source: str) -> int:
        """Bytes of planned fetches from `source` not yet reported done."""
        return self._inflight_bytes.get(source, 0)

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self, req: ScheduleRequest, now_s: float) -> Decision:
        """Place `req` or reject it; a placement is booked at once (queue, decode, fetch, index)."""
        if req.request_id in self._placed:
            raise ValueError(f"request {req.request_id!r} is already placed")
        if not self._decodes or not (self._prefill_pool or self._uses_cpp(req)):
            return Rejection(req.request_id, RejectReason.NO_INSTANCE, self.config.min_retry_after_s,
                             float("inf"), float("inf"), (), ())
        match = self.index.match(req.block_keys)
        local_blocks = self._local_blocks(req, match)
        source = self._fetch_source(match)
        group: tuple[str, ...] = ()
        if self._uses_cpp(req):
            candidates, ttfts, local_blocks = self._estimate_cpp(req, match, local_blocks, source,
                                                                 now_s)
            chosen_at = min(range(len(ttfts)), key=ttfts.__getitem__)
            group = self._cpp_groups[chosen_at]
        else:
            candidates, ttfts = self._estimate_prefills(req, match, local_blocks, source, now_s)
            chosen_at = self._choose_prefill(candidates, ttfts)
        chosen = candidates[chosen_at]
        ttft_s = chosen.ttft_s
        decode_candidates = self._estimate_decodes(req, chosen.instance_id, now_s, ttft_s)
        best_decode = self._choose_decode(decode_candidates)
        rejection = self._admit(req, now_s, ttft_s, best_decode, candidates, decode_candidates)
        if rejection is not None:
            return rejection
        fetch = self._fetch_plan(req, chosen, local_blocks[chosen_at], source)
        self._book(req, now_s, chosen, best_decode.instance_id, fetch, group)
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
        pool = self._prefill_pool
        by_holder = match.blocks_by_holder
        blocks = list(map(by_holder.get, pool, repeat(0))) if by_holder else [0] * len(pool)
        pending = self.pending.match(req.block_keys)
        if pending is not None and pending.blocks_by_holder:
            blocks = list(map(max, blocks, map(pending.blocks_by_holder.get, pool, repeat(0))))
        return blocks

    def _fetch_source(self, match: PrefixMatch) -> str | None:
        """Of the holders of the longest prefix, the one whose link is least loaded: fewest
        bytes of planned fetches still in flight from it, then registration (pool) order."""
        holders = match.best_holders
        if len(holders) <= 1:
            return match.best_holder
        inflight = self._inflight_bytes
        return min(holders, key=lambda holder: inflight.get(holder, 0))

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
        pool = self._prefill_pool
        predicted: dict[int, float] = {}  # prefix_len -> prefill seconds; few distinct per request
        plan_of = {n: self._plan_prefill(req, match, n, source, predicted)
                   for n in dict.fromkeys(blocks)}
        plans = list(map(plan_of.__getitem__, blocks))
        books = map(self._queues.__getitem__, pool) if self._cpp_members else self._queues.values()
        queues = list(map(PrefillQueue.queue_s, books, repeat(now_s)))
        ttfts = [plan[2] + queue_s + plan[3] for plan, queue_s in zip(plans, queues, strict=True)]
        if self.config.fetch_only_if_faster:
            _turn_down_slow_fetches(plans, queues, ttfts)
        return LazyPrefillCandidates(pool, tuple(plans), tuple(queues)), ttfts

    # ---- chunked pipeline parallelism ---------------------------------------------------------

    def _uses_cpp(self, req: ScheduleRequest) -> bool:
        threshold = self.config.cpp_min_tokens
        return threshold is not None and req.prompt_len >= threshold and bool(self._cpp_groups)

    def _estimate_cpp(self, req: ScheduleRequest, match: PrefixMatch, blocks: list[int],
                      source: str | None,
                      now_s: float) -> tuple[LazyPrefillCandidates, list[float], list[int]]:
        """Algorithm 1 over the CPP groups instead of the instances: a group reuses the prefix
        all its members hold, waits for its busiest member, and prefills in
        `pipelined_prefill_s`. Candidates are named by each group's first instance; returns
        them, their TTFTs and each group's local prefix blocks."""
        position = {instance_id: i for i, instance_id in enumerate(self._prefill_pool)}
        queues = self._queues
        group_blocks, group_queues = [], []
        for group in self._cpp_groups:
            # a dedicated member (not in the pool) holds no whole block: no local prefix
            group_blocks.append(min(blocks[position[m]] if m in position else 0 for m in group))
            group_queues.append(max(queues[m].queue_s(now_s) for m in group))
        predicted: dict[int, float] = {}  # prefix_len -> pipelined prefill seconds
        # dedicated members read no prefix from others (a stage holds a slice of each block):
        # their prompt is recomputed, and predicted so
        fetch_from = None if self._cpp_members else source
        plans = [self._plan_prefill(req, match, n, fetch_from, predicted, pipelined=True)
                 for n in group_blocks]
        ttfts = [plan[2] + queue_s + plan[3] for plan, queue_s in zip(plans, group_queues,
                                                                     strict=True)]
        leads = tuple(group[0] for group in self._cpp_groups)
        return LazyPrefillCandidates(leads, tuple(plans), tuple(group_queues)), ttfts, group_blocks

    def _plan_prefill(self, req: ScheduleRequest, match: PrefixMatch, num_blocks: int,
                      source: str | None, predicted: dict[int, float],
                      pipelined: bool = False) -> _Plan:
        """Fetch or recompute, for an instance holding `num_blocks` prefix blocks (Algorithm 1)."""
        cfg = self.config
        local_len = self._reuse_len(req, num_blocks)
        best_len = self._reuse_len(req, match.best_blocks)
        if (cfg.policy is Policy.GLOBAL_CACHE and source is not None
                and best_len > cfg.kvcache_balancing_threshold * local_len):
            fetch_bytes = (best_len - local_len) * self._kv_bytes_per_token
            backlog = self._inflight_bytes.get(source, 0)
            transfer_s = (backlog + fetch_bytes) / self._bandwidth
            recompute_s = (self._prefill_s(req, local_len, predicted, pipelined)
                           if cfg.fetch_only_if_faster else None)
            return (local_len, best_len, transfer_s,
                    self._prefill_s(req, best_len, predicted, pipelined), recompute_s)
        return local_len, local_len, 0.0, self._prefill_s(req, local_len, predicted, pipelined), None

    def _prefill_s(self, req: ScheduleRequest, prefix_len: int, predicted: dict[int, float],
                   pipelined: bool = False) -> float:
        if prefix_len not in predicted:
            # The model is a pure function of its arguments, and prompt lengths repeat: keep its
            # answers (a bounded table, cleared when full) rather than ask again.
            key = (req.prompt_len, prefix_len)
            seconds = self._predicted_prefill_s.get(key)
            if seconds is None:
                if len(self._predicted_prefill_s) >= _MAX_PREDICTIONS:
                    self._predicted_prefill_s.clear()
                seconds = self._predicted_prefill_s[key] = self._prefill_model.predict(*key)
            if pipelined:
                cfg = self.config
                seconds = pipelined_prefill_s(seconds, req.prompt_len - prefix_len,
                                              cfg.cpp_nodes, cfg.cpp_chunk_tokens)
            predicted[prefix_len] = seconds
        return predicted[prefix_len]

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

    def _estimate_decodes(self, req: ScheduleRequest, prefill_id: str, now_s: float,
                          ttft_s: float) -> tuple[DecodeEstimate, ...]:
        at_s = now_s + ttft_s if self.config.admission is Admission.EARLY else now_s
        context = req.prompt_len + req.max_output_len // 2
        loads = self._decodes
        if self.config.policy is Policy.COLOCATED:
            loads = {prefill_id: self._decodes[prefill_id]}
        step = self._decode_model.decode_step_time_s
        fits = self._kv_fits
        # An estimate is a pure function of (instance, batch, context tokens), and an instance's
        # forecast rarely changes between decisions: reuse the last estimate when it matches
        # rather than asking the model again and allocating a new record.
        last_estimates = self._last_decode_estimates
        new = tuple.__new__  # what DecodeEstimate(...) does, without its Python-level __new__
        estimates = []
        now = self.config.admission is not Admission.EARLY
        forecasts = map(self._load_at(now), loads.values(), repeat(at_s))
        for instance_id, (batch, tokens) in zip(loads, forecasts, strict=True):
            batch, tokens = batch + 1, tokens + context
            if not fits(req, batch, tokens, loads[instance_id]):
                estimates.append(new(DecodeEstimate, (instance_id, batch, tokens, math.inf)))
                continue
            estimate = last_estimates.get(instance_id)
            if estimate is None or estimate[1] != batch or estimate[2] != tokens:
                estimate = new(DecodeEstimate, (instance_id, batch, tokens, step(batch, tokens)))
                last_estimates[instance_id] = estimate
            estimates.append(estimate)
        return tuple(estimates)

    def _load_at(self, now: bool) -> Callable[[DecodeLoad, float], tuple[int, int]]:
        """How a decode instance's batch is read: at a later moment, the forecast (requests
        predicted to have finished by then left out); now, under a uniform decode time t_d, the
        reported batch (a request that outlives t_d still decodes: the paper's t_d forecasts
        the future, the load of the moment is known)."""
        if now and self.config.uniform_decode_s is not None:
            return DecodeLoad.batch_now
        return DecodeLoad.batch_at

    def _kv_fits(self, req: ScheduleRequest, batch_size: int, context_tokens: int,
                 load: DecodeLoad | None = None) -> bool:
        """Whether a batch of `batch_size` requests like `req`, holding `context_tokens` on
        average (prompt + max_output_len // 2 each), fits `decode_kv_capacity_tokens` when each
        reserves its prompt plus its whole output. Where it does not, the predicted TBT is +inf:
        its requests would wait for memory, a gap no step time shows. Where the instance reported
        its KV (`on_decode_kv`), what it holds beyond the book is counted too."""
        capacity = self.config.decode_kv_capacity_tokens
        if capacity is None:
            return True
        rest_of_output = req.max_output_len - req.max_output_len // 2
        extra = 0 if load is None else load.kv_undercount(rest_of_output)
        return context_tokens + batch_size * rest_of_output + extra <= capacity

    def _choose_decode(self, candidates: tuple[DecodeEstimate, ...]) -> DecodeEstimate:
        # Least predicted TBT; among equals (e.g. all idle at the forecast time) the instance with
        # the fewest requests booked, so a burst does not pile onto the first instance.
        tbts = list(map(_TBT_S, candidates))
        best_tbt = min(tbts)
        if tbts.count(best_tbt) == 1 and best_tbt == best_tbt:  # (NaN: no ties, as ==)
            return candidates[tbts.index(best_tbt)]
        decodes = self._decodes
        chosen: DecodeEstimate | None = None
        fewest = 0
        for candidate in candidates:  # the first of the least booked, as min() would pick
            if candidate[3] == best_tbt:
                num_booked = decodes[candidate[0]].num_booked
                if chosen is None or num_booked < fewest:
                    chosen, fewest = candidate, num_booked
        if chosen is None:
            raise ValueError(f"no decode candidate has the least predicted TBT {best_tbt!r}")
        return chosen

    def _admit(self, req: ScheduleRequest, now_s: float, ttft_s: float, decode: DecodeEstimate,
               candidates: LazyPrefillCandidates,
               decode_candidates: tuple[DecodeEstimate, ...]) -> Rejection | None:
        cfg = self.config
        if cfg.admission is Admission.NONE:
            return None
        if ttft_s > cfg.ttft_slo_s:
            reason, retry_s = RejectReason.TTFT_SLO, ttft_s - cfg.ttft_slo_s
        elif cfg.admission is Admission.DECODE_AFTER_PREFILL:
            return None  # the decode side is asked later, by admit_decode
        elif decode.tbt_s > cfg.tbt_slo_s:
            at_s = now_s + ttft_s if cfg.admission is Admission.EARLY else now_s
            next_finish = self._decodes[decode.instance_id].next_finish_after(at_s)
            reason, retry_s = RejectReason.TBT_SLO, (0.0 if next_finish is None else next_finish - now_s)
        else:
            return None
        return Rejection(req.request_id, reason, max(cfg.min_retry_after_s, retry_s), ttft_s,
                         decode.tbt_s, candidates.expand(), decode_candidates)

    def _fetch_plan(self, req: ScheduleRequest, chosen: PrefillEstimate, local_blocks: int,
                    source: str | None) -> FetchPlan | None:
        if chosen.prefix_len <= chosen.local_len or source is None:
            return None
        last = -(-chosen.prefix_len // req.block_size)  # blocks covering the reused tokens
        keys = tuple(req.block_keys[local_blocks:last])
        num_bytes = (chosen.prefix_len - chosen.local_len) * self._kv_bytes_per_token
        return FetchPlan(source, keys, chosen.local_len, chosen.prefix_len, num_bytes,
                         chosen.transfer_s)

    def _book(self, req: ScheduleRequest, now_s: float, chosen: PrefillEstimate, decode_id: str,
              fetch: FetchPlan | None, group: tuple[str, ...] = ()) -> None:
        rid = req.request_id
        members = group or (chosen.instance_id,)
        if group:  # the pipeline holds every member for its whole duration
            self._group_of[rid] = group
        for member in members:
            self._queues[member].add(rid, chosen.prefill_s)
        context = req.prompt_len + req.max_output_len // 2
        self._decodes[decode_id].expect(rid, now_s + chosen.ttft_s, context, req.max_output_len)
        self._placed[rid] = (chosen.instance_id, decode_id)
        if fetch is not None:
            self._inflight_bytes[fetch.source] = self._inflight_bytes.get(fetch.source, 0) + fetch.num_bytes
            self._transfers[rid] = (fetch.source, fetch.num_bytes)
        if self.config.index_on_placement:  # local to the instance from now, fetchable once stored
            self.pending.add(rid, members, req.block_keys)

    # ---- reports from the caller --------------------------------------------------------------

    def on_prefill_started(self, instance_id: str, request_id: str, now_s: float) -> None:
        """The prefill began (a CPP request: on its group; report it for any member)."""
        for member in self._group_of.get(request_id, (instance_id,)):
            self._queue(member).start(request_id, now_s)

    def on_prefill_finished(self, instance_id: str, request_id: str, now_s: float) -> None:
        """The prefill ended; its blocks stop being pending (report them with `on_blocks_stored`,
        for every member of a CPP group)."""
        group = self._group_of.pop(request_id, None)
        if group is None:
            self._queue(instance_id).remove(request_id)
        for member in group or ():
            if member in self._queues:
                self._queues[member].remove(request_id)
        self.pending.release(request_id)

    def on_transfer_done(self, request_id: str, now_s: float) -> None:
        """The planned fetch of `request_id` completed (or failed): its bytes no longer queue."""
        source, num_bytes = self._transfers.pop(request_id, ("", 0))
        if num_bytes:
            left = self._inflight_bytes.get(source, 0) - num_bytes
            if left > 0:
                self._inflight_bytes[source] = left
            else:
                self._inflight_bytes.pop(source, None)

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
        added (its booking moves there): that instance's estimate. A Rejection (the request
        forgotten, as `on_request_aborted`) when even that TBT exceeds the SLO: the prefill was
        spent for nothing. Under every other admission mode the decision was made at arrival:
        None."""
        placed = self._placed.get(request_id)
        if placed is None or not self._checks_decode_after_prefill():
            return None
        prefill_id, booked_on = placed
        expected = self._decode(booked_on).expected(request_id)
        if expected is None:
            return None
        context, output_len = expected
        self._decodes[booked_on].remove(request_id)  # counted below as joining now
        as_request = ScheduleRequest(request_id, 1, (), 1, output_len)
        estimates = []
        load_now = self._load_at(True)
        for instance_id, load in self._decodes.items():
            batch, tokens = load_now(load, now_s)
            batch, tokens = batch + 1, tokens + context
            tbt_s = (self._decode_model.decode_step_time_s(batch, tokens)
                     if self._kv_fits(as_request, batch, tokens, load) else math.inf)
            estimates.append(DecodeEstimate(instance_id, batch, tokens, tbt_s))
        best = self._choose_decode(tuple(estimates))
        if best.tbt_s <= self.config.tbt_slo_s:
            self._decodes[best.instance_id].expect(request_id, now_s, context, output_len)
            self._placed[request_id] = (prefill_id, best.instance_id)
            return best
        self.on_request_aborted(request_id)
        next_finish = self._decodes[best.instance_id].next_finish_after(now_s)
        retry_s = 0.0 if next_finish is None else next_finish - now_s
        return Rejection(request_id, RejectReason.TBT_SLO,
                         max(self.config.min_retry_after_s, retry_s), 0.0, best.tbt_s, (),
                         tuple(estimates))

    def move_decode(self, request_id: str, instance_id: str, now_s: float) -> None:
        """The request admitted after its prefill goes to `instance_id` instead (its decode node
        had no room for it): its booking, expected to join now, moves there."""
        placed = self._placed.get(request_id)
        if placed is None or placed[1] == instance_id:
            return
        prefill_id, booked_on = placed
        expected = self._decode(booked_on).expected(request_id)
        if expected is None:
            return
        self._decodes[booked_on].remove(request_id)
        self._decode(instance_id).expect(request_id, now_s, *expected)
        self._placed[request_id] = (prefill_id, instance_id)

    def _checks_decode_after_prefill(self) -> bool:
        admission = self.config.admission
        if admission is Admission.DECODE_AFTER_PREFILL:
            return True
        return self.config.decode_check_after_prefill and admission in (Admission.SLO,
                                                                        Admission.EARLY)

    def on_decode_joined(self, instance_id: str, request_id: str, now_s: float) -> None:
        self._decode(instance_id).join(request_id, now_s, self._decode_model.decode_step_time_s,
                                       self.config.uniform_decode_s)

    def on_decode_kv(self, instance_id: str, reserved_tokens: int) -> None:
        """The decode instance reports the KV tokens it holds reserved now (its own books: a
        request's prompt plus its output). The KV checks count what it holds beyond this
        Conductor's book (`DecodeLoad.kv_undercount`)."""
        if reserved_tokens < 0:
            raise ValueError(f"reserved_tokens must be >= 0, got {reserved_tokens}")
        load = self._decode(instance_id)
        load.reported_kv_tokens = reserved_tokens

    def on_decode_finished(self, instance_id: str, request_id: str, now_s: float) -> None:
        self._decode(instance_id).remove(request_id)
        self._placed.pop(request_id, None)

    def on_request_aborted(self, request_id: str) -> None:
        """Forget every booking of `request_id` (client gone, instance failed)."""
        self.on_transfer_done(request_id, 0.0)
        self.pending.release(request_id)
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        prefill_id, decode_id = placed
        for member in self._group_of.pop(request_id, (prefill_id,)):
            if member in self._queues:
                self._queues[member].remove(request_id)
        if decode_id in self._decodes:
            self._decodes[decode_id].remove(request_id)

    def _queue(self, instance_id: str) -> PrefillQueue:
        try:
            return self._queues[instance_id]
        except KeyError:
            raise ValueError(f"unknown prefill instance {instance_id!r}; known: "
                             f"{', '.join(self._queues)}") from None

    def _decode(self, instance_id: str) -> DecodeLoad:
        try:
            return self._decodes[instance_id]
        except KeyError:
            raise ValueError(f"unknown decode instance {instance_id!r}; known: "
                             f"{', '.join(self._decodes)}") from None

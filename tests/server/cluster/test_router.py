"""Routing and admission through the Conductor (router.py): pools by role, rejections as
`Rejected`, the live index from worker events, the store audit's part, draining."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from kvcake.conductor import Admission, ConductorConfig, Placement, Policy
from kvcake.hashing import block_keys
from kvcake.server.cluster.router import STORE_HOLDER, Router, schedule_request
from kvcake.server.cluster.store_audit import StoreAudit
from kvcake.server.frontend.backend import GenerateRequest, Rejected
from kvcake.server.worker.messages import Hello, KvEvents, PrefillDone, StoreEvents
from kvcake.types import RequestId
from tests.server.cluster.fakes import BLOCK_SIZE, DECODE, NUM_BLOCKS, PREFILL, hello

HELLOS = [hello("prefill-0", "prefill"), hello("prefill-1", "prefill"), hello("decode-2", "decode")]
PROMPT = tuple(range(1, 65))  # 4 full blocks


def router(policy: Policy = Policy.GLOBAL_CACHE, audit: StoreAudit | None = None,
           hellos: Sequence[Hello] = HELLOS) -> Router:
    config = ConductorConfig.from_dict({"policy": policy, "transfer_bandwidth_bytes_per_s": 1e7})
    return Router.for_workers(config, hellos, PREFILL, DECODE, audit)


def keys_of(prompt: tuple[int, ...]) -> list[int]:
    return [int(k) for k in block_keys(prompt, BLOCK_SIZE, HELLOS[0].namespace)]


def holders(r: Router, prompt: tuple[int, ...]) -> dict[str, int]:
    return dict(r.conductor.index.match(keys_of(prompt)).blocks_by_holder)


def test_pools_follow_the_workers_roles() -> None:
    r = router()
    assert (r.conductor.prefill_ids, r.conductor.decode_ids) == (["prefill-0", "prefill-1"],
                                                                 ["decode-2"])
    assert r.block_size == BLOCK_SIZE
    colocated = router(Policy.COLOCATED, hellos=[hello("colocated-0", "colocated"),
                                                 hello("colocated-1", "colocated")])
    assert colocated.conductor.prefill_ids == ["colocated-0", "colocated-1"]
    assert colocated.conductor.decode_ids == ["colocated-0", "colocated-1"]


def test_schedule_request_hashes_the_prompt_in_the_workers_namespace() -> None:
    request = GenerateRequest(RequestId("r"), PROMPT + (7,), 9)
    schedule = schedule_request(request, HELLOS[0])
    assert schedule.request_id == "r" and schedule.block_keys == tuple(keys_of(PROMPT))
    assert (schedule.prompt_len, schedule.block_size, schedule.max_output_len) == (65, BLOCK_SIZE, 9)


def test_a_rejection_is_rejected_with_the_predictions_and_retry_after() -> None:
    r = router()
    for worker_id in ("prefill-0", "prefill-1"):
        r.set_draining(worker_id, "prefill", True)
    with pytest.raises(Rejected) as caught:
        r.place(schedule_request(GenerateRequest(RequestId("r"), PROMPT, 4), HELLOS[0]), 0.0)
    assert caught.value.reason == ("the Conductor rejected the request (no_instance: predicted "
                                   "TTFT inf s, TBT inf s)")
    assert caught.value.retry_after_s == ConductorConfig().min_retry_after_s


def test_only_prefill_workers_cache_events_feed_the_index() -> None:
    r = router()
    keys = keys_of(PROMPT)
    r.on_kv_events("decode-2", KvEvents(keys, []))
    r.on_kv_events("prefill-1", KvEvents(keys, []))
    assert holders(r, PROMPT) == {"prefill-1": 4}
    r.on_kv_events("prefill-1", KvEvents([], keys[2:]))
    assert holders(r, PROMPT) == {"prefill-1": 2}


def test_store_events_are_listed_under_the_store_and_tracked_by_the_audit() -> None:
    audit = StoreAudit("ns", max_keys=8, max_tracked=3)
    r = router(audit=audit)
    keys = keys_of(PROMPT)
    r.on_store_events(StoreEvents(keys))  # 4 keys, 3 tracked: the oldest leaves the index
    assert len(audit) == 3 and holders(r, PROMPT) == {}
    assert dict(r.conductor.index.match(keys[1:]).blocks_by_holder) == {STORE_HOLDER: 3}
    r.on_store_events(StoreEvents(keys[:1]))  # block 0 again: now block 1 is the oldest
    assert holders(r, PROMPT) == {STORE_HOLDER: 1} and len(audit) == 3
    r.on_store_gone(keys[:1])
    assert holders(r, PROMPT) == {}


def test_a_short_fetch_makes_the_audit_check_its_keys_first() -> None:
    audit = StoreAudit("ns", max_keys=2)
    r = router(audit=audit)
    keys = keys_of(PROMPT)
    audit.track([1, 2])
    r.on_store_events(StoreEvents(keys))
    placement = r.place(schedule_request(GenerateRequest(RequestId("r"), PROMPT + (1,), 4), HELLOS[0]), 0.0)
    assert placement.fetch is not None and placement.fetch.keys == tuple(keys)
    short = PrefillDone("r", 9, None, num_cached_tokens=16, num_fetched_tokens=16, compute_s=0.1,
                        transfer_span_s=0.0, transfer_exposed_s=0.0, transfer_bytes=0)
    r.prefill_done(placement, short, 1.0)
    assert [k for k, _ in audit.take_round()] == keys[:2]


def test_draining_takes_a_worker_out_and_resuming_brings_it_back() -> None:
    r = router()
    r.set_draining("prefill-0", "prefill", True)
    r.set_draining("prefill-0", "prefill", True)  # already out: no-op
    assert r.conductor.prefill_ids == ["prefill-1"]
    r.set_draining("decode-2", "decode", True)
    r.set_draining("decode-2", "decode", False)
    r.set_draining("prefill-0", "prefill", False)
    assert (r.conductor.prefill_ids, r.conductor.decode_ids) == (["prefill-1", "prefill-0"],
                                                                 ["decode-2"])
    r.remove("prefill-1")
    assert r.conductor.prefill_ids == ["prefill-0"]
    colocated = router(Policy.COLOCATED, hellos=[hello("c-0", "colocated")])
    colocated.set_draining("c-0", "colocated", True)
    colocated.set_draining("c-0", "colocated", False)
    assert (colocated.conductor.prefill_ids, colocated.conductor.decode_ids) == (["c-0"], ["c-0"])


def test_a_reported_fetch_sets_the_bandwidth_the_next_placement_is_planned_at() -> None:
    # 64 of 65 prompt tokens in the store (16,384 KV bytes): recomputing takes 0.065 s, fetching
    # 16,384 B / bandwidth + 0.001 s; fetch_only_if_faster weighs the two.
    config = ConductorConfig.from_dict({"policy": Policy.GLOBAL_CACHE, "admission": "none",
                                        "transfer_bandwidth_bytes_per_s": 1e7,
                                        "fetch_only_if_faster": True})
    r = Router.for_workers(config, HELLOS, PREFILL, DECODE)
    r.on_store_events(StoreEvents(keys_of(PROMPT)))

    def place(rid: str) -> Placement:
        return r.place(schedule_request(GenerateRequest(RequestId(rid), PROMPT + (1,), 4),
                                        HELLOS[0]), 0.0)

    first = place("r")
    assert first.fetch is not None
    no_fetch = PrefillDone("r", 9, None, num_cached_tokens=0, num_fetched_tokens=0,
                           compute_s=0.1, transfer_span_s=0.0, transfer_exposed_s=0.0,
                           transfer_bytes=0)
    r.prefill_done(first, no_fetch, 1.0)
    assert r.conductor.transfer_bandwidth == 1e7  # nothing measured
    r.request_ended("r")
    slow = PrefillDone("s", 9, None, num_cached_tokens=64, num_fetched_tokens=64, compute_s=0.1,
                       transfer_span_s=0.0, transfer_exposed_s=0.0, transfer_bytes=0,
                       fetch_bytes=1_000_000, fetch_s=10.0)
    second = place("s")
    assert second.fetch is not None
    r.prefill_done(second, slow, 2.0)
    r.request_ended("s")
    assert r.conductor.transfer_bandwidth == pytest.approx(1e5)
    assert place("t").fetch is None  # fetching is slower now


def test_early_rejection_forecasts_against_the_decode_workers_kv_pool() -> None:
    # The decode worker's pool (64 blocks of 16 = 1,024 tokens) is the capacity the prediction
    # checks: a request reserving more than it holds is refused at arrival (HTTP 429), as the
    # paper's early rejection does, rather than admitted to wait for decode memory.
    config = ConductorConfig.from_dict({"admission": "early", "transfer_bandwidth_bytes_per_s": 1e7})
    r = Router.for_workers(config, HELLOS, PREFILL, DECODE)
    assert r.conductor.config.decode_kv_capacity_tokens == NUM_BLOCKS * BLOCK_SIZE
    fits = r.place(schedule_request(GenerateRequest(RequestId("a"), PROMPT, 400), HELLOS[0]), 0.0)
    assert fits.decode_id == "decode-2"
    with pytest.raises(Rejected) as caught:  # 64 + 2,000 tokens > 1,024 tokens of KV
        r.place(schedule_request(GenerateRequest(RequestId("b"), PROMPT, 2000), HELLOS[0]), 0.0)
    assert "tbt_slo" in caught.value.reason and "TBT inf s" in caught.value.reason
    configured = Router.for_workers(replace(config, decode_kv_capacity_tokens=10**6), HELLOS,
                                    PREFILL, DECODE)
    assert configured.conductor.config.decode_kv_capacity_tokens == 10**6
    configured.place(schedule_request(GenerateRequest(RequestId("b"), PROMPT, 2000), HELLOS[0]),
                     0.0)
    with pytest.raises(ValueError, match="simulator baseline"):
        Router.for_workers(replace(config, admission=Admission.DECODE_AFTER_PREFILL), HELLOS, PREFILL,
                           DECODE)


def test_cpp_stages_are_placed_only_as_their_group_in_stage_order() -> None:
    """Dedicated CPP stages (role cpp) join the Conductor as one group in stage order, whatever
    order they registered in; long prompts go to the group, short ones to the plain prefill
    worker; a lost stage breaks the group and long prompts fall back to the plain worker."""
    config = ConductorConfig.from_dict({"cpp_min_tokens": 200, "cpp_nodes": 2,
                                        "cpp_chunk_tokens": 64, "cpp_min_chunk_tokens": 16,
                                        "admission": "none"})
    stages = [replace(hello("cpp-3", "cpp"), cpp_member=1),
              replace(hello("cpp-2", "cpp"), cpp_member=0)]
    r = Router.for_workers(config, [hello("prefill-0", "prefill"), hello("decode-1", "decode"),
                                    *stages], PREFILL, DECODE)
    assert r.conductor.cpp_groups == (("cpp-2", "cpp-3"),)

    def place(rid: str, n: int) -> Placement:
        return r.place(schedule_request(GenerateRequest(RequestId(rid), tuple(range(n)), 4),
                                        HELLOS[0]), 0.0)

    r.on_store_events(StoreEvents(keys_of(tuple(range(160)))))  # the store holds 10 blocks
    long = place("long", 300)
    assert (long.prefill_id, long.prefill_group) == ("cpp-2", ("cpp-2", "cpp-3"))
    # each stage reads its layers of the stored prefix: the group fetches it
    assert long.fetch is not None and len(long.fetch.keys) == 10
    # predicted as a pipeline of the 140 new tokens only (3 chunks of 64 on 2 stages)
    assert long.prefix_len == 160
    assert long.chosen.prefill_s == pytest.approx(PREFILL.predict(300, 160) * 4 / 6)
    short = place("short", 150)
    assert (short.prefill_id, short.prefill_group) == ("prefill-0", ())
    assert short.fetch is not None and len(short.fetch.keys) == 9
    r.remove("cpp-2")
    assert r.conductor.cpp_groups == ()
    assert place("long-2", 300).prefill_id == "prefill-0"
    r.set_draining("cpp-2", "cpp", False, cpp_member=0)  # restarted: rejoins as stage 0
    assert r.conductor.cpp_groups == (("cpp-2", "cpp-3"),)
    assert place("long-3", 300).prefill_group == ("cpp-2", "cpp-3")

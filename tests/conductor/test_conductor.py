"""Algorithm 1 and the baselines on hand-built cluster views, with exact numbers.

Models used throughout (real predictors with chosen coefficients):
  prefill_s = (n - p) / 1000          decode step (TBT) = 0.01 + 0.001 * batch_size
  KV: 1000 bytes per token over 1e7 bytes/s -> a fetch of t tokens takes t / 10000 s.
Block size 16; keys are small ints.
"""

from __future__ import annotations

import random

import pytest

from kvcake.conductor import (
    Admission,
    Conductor,
    ConductorConfig,
    CostModel,
    DecodeEstimate,
    DecodeStepPredictor,
    Placement,
    Policy,
    PrefillTimePredictor,
    Rejection,
    RejectReason,
    ScheduleRequest,
)

BS = 16
PREFILL = PrefillTimePredictor(1, 1.0, [0.0, 0.001, -0.001])
DECODE = DecodeStepPredictor([0.01, 0.001, 0.0])


def make(policy: str = "global_cache", num_prefill: int = 2, num_decode: int = 2,
         **overrides: object) -> Conductor:
    settings: dict[str, object] = dict(policy=policy, transfer_bandwidth_bytes_per_s=1e7,
                                       ttft_slo_s=30.0, tbt_slo_s=1.0)
    settings.update(overrides)
    config = ConductorConfig.from_dict(settings)
    return Conductor(config, [f"p{i}" for i in range(num_prefill)],
                     [f"d{i}" for i in range(num_decode)], PREFILL, DECODE, 1000)


def request(rid: str, prompt_len: int = 200, num_keys: int | None = None, first_key: int = 0,
            output_len: int = 10) -> ScheduleRequest:
    n = prompt_len // BS if num_keys is None else num_keys
    return ScheduleRequest(rid, prompt_len, tuple(range(first_key, first_key + n)), BS, output_len)


def busy(conductor: Conductor, instance: str, seconds: float) -> None:
    """Put `seconds` of queued prefill on `instance` (a request placed there earlier)."""
    conductor.prefill_queue(instance).add(f"filler-{instance}", seconds)


def placed(decision: object) -> Placement:
    assert isinstance(decision, Placement), decision
    return decision


def test_fetches_the_best_prefix_to_an_idle_instance() -> None:
    c = make(index_on_placement=False)
    c.on_blocks_stored("p0", range(8))  # 128 tokens of the 200-token prompt
    busy(c, "p0", 0.5)
    d = placed(c.schedule(request("r"), now_s=0.0))
    assert (d.prefill_id, d.prefix_len) == ("p1", 128)
    assert d.fetch is not None
    assert (d.fetch.source, d.fetch.keys, d.fetch.start_len, d.fetch.end_len) == ("p0", tuple(range(8)), 0, 128)
    assert d.fetch.num_bytes == 128_000 and d.fetch.transfer_s == pytest.approx(0.0128)
    p0, p1 = d.prefill_candidates
    assert (p0.local_len, p0.prefix_len, p0.transfer_s, p0.queue_s) == (128, 128, 0.0, 0.5)
    assert p0.prefill_s == pytest.approx(0.072)
    assert (p1.local_len, p1.prefix_len) == (0, 128)
    assert p1.ttft_s == pytest.approx(0.0128 + 0.072)
    assert d.predicted_ttft_s == pytest.approx(p1.ttft_s)


def test_stays_on_the_holder_when_its_queue_is_short() -> None:
    c = make()
    c.on_blocks_stored("p0", range(8))
    busy(c, "p0", 0.01)
    d = placed(c.schedule(request("r"), 0.0))
    assert (d.prefill_id, d.prefix_len, d.fetch) == ("p0", 128, None)
    assert d.predicted_ttft_s == pytest.approx(0.01 + 0.072)


def test_threshold_boundary_recomputes_at_equality_and_fetches_above() -> None:
    # p1 holds 4 blocks (64 tokens), p0 holds 8 (128): ratio exactly 2.
    for threshold, expect_prefix, expect_fetch in [(2.0, 64, False), (1.99, 128, True)]:
        c = make(kvcache_balancing_threshold=threshold)
        c.on_blocks_stored("p0", range(8))
        c.on_blocks_stored("p1", range(4))
        busy(c, "p0", 5.0)
        d = placed(c.schedule(request("r"), 0.0))
        assert d.prefill_id == "p1"
        assert d.prefix_len == expect_prefix
        assert (d.fetch is not None) == expect_fetch
        if d.fetch is not None:
            assert d.fetch.keys == (4, 5, 6, 7) and d.fetch.start_len == 64
            assert d.fetch.transfer_s == pytest.approx(64 * 1000 / 1e7)


def test_zero_local_prefix_fetches_anything_and_nothing_held_fetches_nothing() -> None:
    c = make(kvcache_balancing_threshold=1000.0)
    c.on_blocks_stored("store", [0])  # one block, in the store tier only
    d = placed(c.schedule(request("r"), 0.0))
    assert d.fetch is not None and d.fetch.source == "store" and d.prefix_len == 16
    d2 = placed(c.schedule(request("s", first_key=100), 0.0))
    assert d2.fetch is None and d2.prefix_len == 0


def test_the_last_prompt_token_is_never_reused() -> None:
    c = make()
    c.on_blocks_stored("p0", range(3))
    d = placed(c.schedule(ScheduleRequest("r", 48, (0, 1, 2), BS, 5), 0.0))
    assert d.prefix_len == 47
    assert d.chosen.prefill_s == pytest.approx(0.001)
    # Fetched whole to a cold instance, too: 47 tokens, all three blocks' KV moved.
    busy(c, "p0", 5.0)
    f = placed(c.schedule(ScheduleRequest("s", 48, (0, 1, 2), BS, 5), 0.0))
    assert (f.prefill_id, f.prefix_len) == ("p1", 47)
    assert f.fetch is not None and f.fetch.keys == (0, 1, 2) and f.fetch.num_bytes == 47_000


def test_fetch_only_if_faster_keeps_recompute_when_the_network_is_slow() -> None:
    c = make(fetch_only_if_faster=True, transfer_bandwidth_bytes_per_s=1e5)  # 100 tokens/s
    c.on_blocks_stored("p0", range(8))
    busy(c, "p0", 5.0)
    d = placed(c.schedule(request("r"), 0.0))
    assert (d.prefill_id, d.fetch, d.prefix_len) == ("p1", None, 0)
    c2 = make(transfer_bandwidth_bytes_per_s=1e5)  # Algorithm 1 as written: threshold only
    c2.on_blocks_stored("p0", range(8))
    busy(c2, "p0", 5.0)
    d2 = placed(c2.schedule(request("r"), 0.0))
    assert d2.fetch is not None and d2.chosen.transfer_s == pytest.approx(1.28)


def test_hotspot_replication_is_pending_on_placement_and_indexed_on_report() -> None:
    c = make(index_on_placement=True)
    c.on_blocks_stored("p0", range(8))
    busy(c, "p0", 5.0)
    placed(c.schedule(request("r"), 0.0))
    # Not there yet: nobody may fetch them from p1, but p1 counts them as its own prefix.
    assert c.index.match(list(range(12))).blocks("p1") == 0
    pending = c.pending.match(list(range(12)))
    assert pending is not None and pending.blocks("p1") == 12  # fetched + computed blocks
    c.on_prefill_finished("p1", "r", 1.0)
    assert c.pending.match(list(range(12))) is None
    c2 = make(index_on_placement=False)
    c2.on_blocks_stored("p0", range(8))
    busy(c2, "p0", 5.0)
    d = placed(c2.schedule(request("r"), 0.0))
    assert c2.index.match(list(range(12))).blocks("p1") == 0
    assert d.fetch is not None
    c2.on_blocks_stored("p1", d.fetch.keys)
    assert c2.index.match(list(range(12))).blocks("p1") == 8


def test_congested_source_makes_fetches_slower_until_transfer_done() -> None:
    c = make(index_on_placement=False, num_prefill=3)
    c.on_blocks_stored("p0", range(8))
    busy(c, "p0", 5.0)
    first = placed(c.schedule(request("a"), 0.0))
    assert first.prefill_id == "p1" and first.chosen.transfer_s == pytest.approx(0.0128)
    second = placed(c.schedule(request("b"), 0.0))
    # p1 now has a queue (0.072); p2 fetches behind a's 128 000 bytes still in flight.
    assert second.prefill_id == "p2" and second.chosen.transfer_s == pytest.approx(0.0256)
    assert c.inflight_bytes("p0") == 256_000
    c.on_transfer_done("a", 0.1)
    c.on_transfer_done("b", 0.1)
    c.on_transfer_done("b", 0.1)  # duplicate: harmless
    assert c.inflight_bytes("p0") == 0


def test_queue_time_follows_reports() -> None:
    c = make(policy="load_balance", num_prefill=1)
    placed(c.schedule(request("a"), 0.0))  # 0.2 s
    placed(c.schedule(request("b", first_key=50), 0.0))  # 0.2 s
    assert c.queue_s("p0", 0.0) == pytest.approx(0.4)
    c.on_prefill_started("p0", "a", 1.0)
    assert c.queue_s("p0", 1.05) == pytest.approx(0.35)
    c.on_prefill_finished("p0", "a", 1.2)
    assert c.queue_s("p0", 1.2) == pytest.approx(0.2)
    d = placed(c.schedule(request("c", first_key=90), 1.2))
    assert d.chosen.queue_s == pytest.approx(0.2)


def test_decode_selection_prefers_the_lower_predicted_tbt() -> None:
    c = make(admission="slo")
    for rid in ("x", "y"):
        c.decode_load("d0").expect(rid, 0.0, 100, 1000)
        c.on_decode_joined("d0", rid, 0.0)
    c.decode_load("d1").expect("z", 0.0, 100, 1000)
    c.on_decode_joined("d1", "z", 0.0)
    d = placed(c.schedule(request("r"), 0.0))
    assert d.decode_id == "d1" and d.predicted_tbt_s == pytest.approx(0.012)
    assert [(e.instance_id, e.batch_size) for e in d.decode_candidates] == [("d0", 3), ("d1", 2)]
    # An idle tie is broken by fewer requests booked, so a burst spreads out.
    c2 = make(admission="slo")
    assert [placed(c2.schedule(request(r, first_key=k), 0.0)).decode_id
            for r, k in [("a", 0), ("b", 100), ("c", 200)]] == ["d0", "d1", "d0"]


def test_rejects_when_ttft_slo_cannot_be_met() -> None:
    c = make(ttft_slo_s=0.1)
    busy(c, "p0", 1.0)
    busy(c, "p1", 2.0)
    d = c.schedule(request("r"), 0.0)
    assert isinstance(d, Rejection) and d.reason is RejectReason.TTFT_SLO
    assert d.predicted_ttft_s == pytest.approx(1.2)
    assert d.retry_after_s == pytest.approx(1.1)
    assert c.queue_s("p0", 0.0) == 1.0  # nothing booked


def test_rejects_when_tbt_slo_cannot_be_met_and_admission_none_never_rejects() -> None:
    for admission, expect in [("slo", Rejection), ("none", Placement)]:
        c = make(num_decode=1, tbt_slo_s=0.0125, admission=admission)
        for rid in ("x", "y"):
            c.decode_load("d0").expect(rid, 0.0, 100, 1000)
            c.on_decode_joined("d0", rid, 0.0)  # both finish at 1000 * step
        d = c.schedule(request("r"), 0.0)
        assert isinstance(d, expect)
        if isinstance(d, Rejection):
            assert d.reason is RejectReason.TBT_SLO
            assert d.predicted_tbt_s == pytest.approx(0.013)
            # x joined alone (step 0.011), y beside x (0.012): x's finish is the first relief.
            assert d.retry_after_s == pytest.approx(1000 * 0.011)


def test_early_rejection_counts_requests_that_finish_before_prefill_ends() -> None:
    # d0 decodes 2 requests predicted to finish at t = 0.1; the new request's prefill ends at 0.2.
    def cluster(admission: str) -> Conductor:
        c = make(num_decode=1, num_prefill=1, tbt_slo_s=0.0115, admission=admission)
        for rid in ("x", "y"):
            c.decode_load("d0").expect(rid, 0.0, 100, 10)
            c.decode_load("d0").join(rid, 0.0, lambda batch, context: 0.01)  # 10 steps of 0.01 s
        return c

    assert isinstance(cluster("slo").schedule(request("r"), 0.0), Rejection)  # batch 3 now
    d = placed(cluster("early").schedule(request("r"), 0.0))
    assert d.decode_candidates[0].batch_size == 1 and d.predicted_tbt_s == pytest.approx(0.011)


def test_early_rejection_counts_requests_that_will_have_joined() -> None:
    c = make(num_decode=1, num_prefill=2, tbt_slo_s=0.0115, admission="early")
    placed(c.schedule(request("a", prompt_len=100), 0.0))  # joins at 0.1
    # b's prefill (0.2 s on the idle p1) ends after a joined: batch 2 -> 0.012 > SLO.
    d = c.schedule(request("b", first_key=100), 0.0)
    assert isinstance(d, Rejection) and d.reason is RejectReason.TBT_SLO
    # A shorter request that finishes prefill (0.05 s) before a joins is admitted.
    e = placed(c.schedule(request("e", prompt_len=50, first_key=300), 0.0))
    assert e.decode_candidates[0].batch_size == 1


def test_random_policy_is_seeded() -> None:
    def choices(seed: int) -> list[str]:
        c = make(policy="random", num_prefill=8, seed=seed)
        return [placed(c.schedule(request(f"r{i}", first_key=100 * i), 0.0)).prefill_id
                for i in range(10)]

    rng = random.Random(5)
    assert choices(5) == [f"p{rng.randrange(8)}" for _ in range(10)]
    assert choices(5) == choices(5)


def test_load_balance_ignores_the_cache() -> None:
    c = make(policy="load_balance")
    c.on_blocks_stored("p0", range(12))
    busy(c, "p0", 0.01)
    d = placed(c.schedule(request("r"), 0.0))
    assert (d.prefill_id, d.fetch, d.prefix_len) == ("p1", None, 0)


def test_local_cache_never_fetches() -> None:
    c = make(policy="local_cache")
    c.on_blocks_stored("p0", range(8))
    busy(c, "p0", 0.5)
    d = placed(c.schedule(request("r"), 0.0))
    assert (d.prefill_id, d.fetch, d.prefix_len) == ("p1", None, 0)
    assert [x.transfer_s for x in d.prefill_candidates] == [0.0, 0.0]
    busy(c, "p1", 1.0)
    d2 = placed(c.schedule(request("s", first_key=0), 0.0))
    assert (d2.prefill_id, d2.prefix_len) == ("p0", 128)


def test_colocated_decodes_where_it_prefills() -> None:
    cfg = ConductorConfig(policy=Policy.COLOCATED, tbt_slo_s=1.0)
    c = Conductor(cfg, ["i0", "i1"], [], PREFILL, DECODE, 1000)
    c.on_blocks_stored("i1", range(8))
    d = placed(c.schedule(request("r"), 0.0))
    assert (d.prefill_id, d.decode_id, d.prefix_len) == ("i1", "i1", 128)
    assert [e.instance_id for e in d.decode_candidates] == ["i1"]
    with pytest.raises(ValueError, match="colocated"):
        Conductor(cfg, ["i0"], ["d0"], PREFILL, DECODE, 1000)


def test_abort_releases_every_booking() -> None:
    c = make(index_on_placement=False)
    c.on_blocks_stored("p0", range(8))
    busy(c, "p0", 5.0)
    d = placed(c.schedule(request("r"), 0.0))
    c.on_request_aborted("r")
    assert c.queue_s(d.prefill_id, 0.0) == 0.0
    assert c.decode_load(d.decode_id).num_booked == 0 and c.inflight_bytes("p0") == 0
    placed(c.schedule(request("r"), 0.0))  # the id may be used again


def test_bad_reports_are_clear_errors_and_leave_the_conductor_working() -> None:
    c = make()
    with pytest.raises(ValueError, match="unknown prefill instance 'p9'; known: p0, p1"):
        c.on_prefill_started("p9", "r", 0.0)
    with pytest.raises(ValueError, match="unknown decode instance"):
        c.on_decode_joined("p0", "r", 0.0)
    placed(c.schedule(request("r"), 0.0))
    with pytest.raises(ValueError, match="already placed"):
        c.schedule(request("r"), 0.0)
    placed(c.schedule(request("s", first_key=40), 0.0))
    with pytest.raises(ValueError, match="already registered"):
        c.add_prefill_instance("p0")


def test_empty_pool_rejects_with_no_instance() -> None:
    c = make()
    c.remove_instance("d0")
    c.remove_instance("d1")
    d = c.schedule(request("r"), 0.0)
    assert isinstance(d, Rejection) and d.reason is RejectReason.NO_INSTANCE
    c.add_decode_instance("d7")
    assert placed(c.schedule(request("r"), 0.0)).decode_id == "d7"


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="kvcache_balancing_threshold"):
        ConductorConfig(kvcache_balancing_threshold=0.5)
    with pytest.raises(ValueError, match="policy must be one of random, load_balance"):
        ConductorConfig.from_dict({"policy": "best"})
    with pytest.raises(ValueError, match=r"unknown conductor config keys \['ttft_slo'\]"):
        ConductorConfig.from_dict({"ttft_slo": 3})
    with pytest.raises(ValueError, match="tbt_slo_s"):
        ConductorConfig(tbt_slo_s=0)
    assert ConductorConfig(admission="none").admission is Admission.NONE  # type: ignore[arg-type]


def test_schedule_request_validation() -> None:
    with pytest.raises(ValueError, match="prompt_len"):
        ScheduleRequest("r", 0, (), BS, 1)
    with pytest.raises(ValueError, match="exceed prompt_len"):
        ScheduleRequest("r", 20, (1, 2, 3), BS, 1)
    assert ScheduleRequest("r", 33, [1, 2, 3], BS, 1).block_keys == (1, 2, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("bandwidth", "fetches"), [(1e9, False), (100e9, True)])
def test_real_cost_model_fetches_only_above_the_bg_bandwidth(bandwidth: float, fetches: bool) -> None:
    # llama3-70b on 8xA800: reusing an 8192-token prefix pays above ~6 GB/s (seed section IV)
    # at peak FLOP/s, ~3 GB/s at the profile's 50% MFU; 1 GB/s is below, 100 GB/s far above.
    cost = CostModel.from_spec("llama3-70b@a800x8")
    cfg = ConductorConfig(fetch_only_if_faster=True, transfer_bandwidth_bytes_per_s=bandwidth,
                          ttft_slo_s=1e9, tbt_slo_s=1e9)
    c = Conductor(cfg, ["p0", "p1"], ["d0"], cost, cost, cost.model.kv_bytes_per_token)
    c.on_blocks_stored("store", range(16))  # 8192 tokens of a 9000-token prompt, store only
    d = placed(c.schedule(ScheduleRequest("r", 9000, tuple(range(18)), 512, 100), 0.0))
    assert (d.fetch is not None) == fetches
    assert d.prefix_len == (8192 if fetches else 0)
    assert cost.min_reuse_bandwidth_bytes_per_s(8192, use_mfu=True) < 100e9
    assert cost.min_reuse_bandwidth_bytes_per_s(8192, use_mfu=True) > 1e9


def test_pending_blocks_are_local_to_their_instance_but_never_a_fetch_source() -> None:
    c = make(num_prefill=3)
    c.on_blocks_stored("p0", range(4))
    first = placed(c.schedule(request("a", prompt_len=200), 0.0))  # 12 blocks, fetched 4 to p0?
    assert first.prefill_id == "p0" and first.fetch is None
    busy(c, "p0", 5.0)
    # b shares a's 12 blocks: only 4 exist (on p0); 8 are pending on p0. Another instance may
    # fetch the 4 that exist, never the pending 8.
    second = placed(c.schedule(request("b", prompt_len=208, num_keys=13), 0.0))
    assert second.prefill_id != "p0"
    assert second.fetch is not None and second.fetch.source == "p0"
    assert second.fetch.keys == tuple(range(4))
    # Once a's prefill is done and its blocks reported, all 12 can be fetched.
    c.on_prefill_finished("p0", "a", 0.2)
    c.on_blocks_stored("p0", range(12))
    third = placed(c.schedule(request("c", prompt_len=224, num_keys=14), 0.2))
    assert third.fetch is not None and third.fetch.end_len == 12 * BS


def test_fetch_source_is_the_replica_with_the_least_loaded_link() -> None:
    c = make(num_prefill=4, index_on_placement=False)
    c.on_blocks_stored("p0", range(8))
    c.on_blocks_stored("p1", range(8))
    busy(c, "p0", 5.0)
    busy(c, "p1", 5.0)
    first = placed(c.schedule(request("a"), 0.0))
    assert first.fetch is not None and first.fetch.source == "p0"  # a tie: pool order
    second = placed(c.schedule(request("b"), 0.0))
    assert second.fetch is not None and second.fetch.source == "p1"  # p0's link is busy now
    c.on_transfer_done("a", 0.01)
    third = placed(c.schedule(request("c"), 0.01))
    assert third.fetch is not None and third.fetch.source == "p0"


def test_decode_after_prefill_admits_at_arrival_and_rejects_when_the_prefill_is_done() -> None:
    c = make(admission="decode_after_prefill", num_decode=1, tbt_slo_s=0.0125)
    first = placed(c.schedule(request("a", output_len=1000), 0.0))  # TBT 0.011 with a alone
    c.on_prefill_started("p0", "a", 0.0)
    c.on_prefill_finished(first.prefill_id, "a", 0.2)
    admitted = c.admit_decode("a", 0.2)
    assert isinstance(admitted, DecodeEstimate) and admitted.instance_id == "d0"
    c.on_decode_joined("d0", "a", 0.2)
    second = placed(c.schedule(request("b", first_key=100, output_len=1000), 0.2))  # 0.012: fits
    assert isinstance(c.admit_decode("b", 0.4), DecodeEstimate)
    c.on_decode_joined("d0", "b", 0.4)
    # A third would make the step 0.013 s: admitted at arrival all the same (no TBT check)...
    third = placed(c.schedule(request("c", first_key=200), 0.4))
    assert second.decode_id == third.decode_id == "d0"
    # ...and rejected once its prefill is spent; its bookings are forgotten.
    rejection = c.admit_decode("c", 0.6)
    assert isinstance(rejection, Rejection) and rejection.reason is RejectReason.TBT_SLO
    assert rejection.predicted_tbt_s == pytest.approx(0.013)
    assert c.decode_load("d0").num_booked == 2


def test_decode_after_prefill_chooses_the_decode_instance_again_when_the_prefill_ends() -> None:
    c = make(admission="decode_after_prefill", num_decode=2, tbt_slo_s=1.0)
    a = placed(c.schedule(request("a", output_len=1000), 0.0))
    b = placed(c.schedule(request("b", first_key=100, output_len=1000), 0.0))
    assert {a.decode_id, b.decode_id} == {"d0", "d1"}
    assert isinstance(c.admit_decode("a", 0.2), DecodeEstimate)
    c.on_decode_joined(a.decode_id, "a", 0.2)
    c.on_request_aborted("b")  # b's decode instance is free again; a's is busy
    late = placed(c.schedule(request("c", first_key=200), 0.2))
    admitted = c.admit_decode("c", 0.4)
    assert isinstance(admitted, DecodeEstimate)
    assert admitted.instance_id == b.decode_id and admitted.batch_size == 1
    assert c.decode_load(b.decode_id).num_booked == 1 and late.request_id == "c"


def test_decode_check_keeps_node_asks_only_the_instance_chosen_at_arrival() -> None:
    # One request on a decode instance steps in 0.011 s, two in 0.012 s > the SLO. a and b
    # decode on d0 and d1; c arrives (both busy: pre-selected d0, the first of the least
    # booked), then b finishes: when c's prefill ends d1 is empty and d0 still full.
    outcomes = {}
    for keeps in (False, True):
        c = make(admission="decode_after_prefill", num_decode=2, tbt_slo_s=0.0115,
                 decode_check_keeps_node=keeps)
        a = placed(c.schedule(request("a", output_len=1000), 0.0))
        b = placed(c.schedule(request("b", first_key=100, output_len=1000), 0.0))
        assert (a.decode_id, b.decode_id) == ("d0", "d1")
        for rid, d in (("a", "d0"), ("b", "d1")):
            admitted = c.admit_decode(rid, 0.2)
            assert isinstance(admitted, DecodeEstimate) and admitted.instance_id == d
            c.on_decode_joined(d, rid, 0.2)
        assert placed(c.schedule(request("c", first_key=200), 0.2)).decode_id == "d0"
        c.on_decode_finished("d1", "b", 0.3)
        outcomes[keeps] = c.admit_decode("c", 0.4)
    moved, kept = outcomes[False], outcomes[True]
    assert isinstance(moved, DecodeEstimate) and moved.instance_id == "d1"
    assert isinstance(kept, Rejection) and kept.reason is RejectReason.TBT_SLO
    assert kept.predicted_tbt_s == pytest.approx(0.012)


def test_the_keep_node_baseline_pre_selects_on_the_forecast_at_join_so_a_burst_spreads() -> None:
    # a decodes on d0 (1000 tokens: to ~11 s); d1 is empty. A burst of four 200-token prompts
    # arrives at 0.5 on one prefill instance: they join at 0.7, 0.9, 1.1, 1.3. Read now (the
    # default baseline) d1 has the shorter batch for every one of them: all four pile onto d1.
    # Keeping its node, the baseline reads the forecast at each one's join time, counting the
    # ones booked before it: d1 (1 vs 2), then a tie at 2 (fewest booked: d0, the first), d1
    # (2 vs 3), a tie at 3 (d0).
    chosen = {}
    for keeps in (False, True):
        c = make(admission="decode_after_prefill", num_prefill=1, num_decode=2,
                 decode_check_keeps_node=keeps)
        assert placed(c.schedule(request("a", output_len=1000), 0.0)).decode_id == "d0"
        c.on_prefill_finished("p0", "a", 0.2)
        assert isinstance(c.admit_decode("a", 0.2), DecodeEstimate)
        c.on_decode_joined("d0", "a", 0.2)
        burst = [placed(c.schedule(request(f"r{i}", first_key=100 * (i + 1)), 0.5))
                 for i in range(4)]
        assert [d.predicted_ttft_s for d in burst] == pytest.approx([0.2, 0.4, 0.6, 0.8])
        chosen[keeps] = [d.decode_id for d in burst]
        assert [d.predicted_tbt_s for d in burst] == pytest.approx(
            [0.011] * 4 if not keeps else [0.011, 0.012, 0.012, 0.013])
    assert chosen == {False: ["d1"] * 4, True: ["d1", "d0", "d1", "d0"]}


def test_admit_decode_is_a_no_op_under_arrival_admission() -> None:
    c = make(admission="early")
    placed(c.schedule(request("a"), 0.0))
    assert c.admit_decode("a", 0.1) is None
    assert ConductorConfig(admission="prediction").admission is Admission.EARLY  # type: ignore[arg-type]


def test_early_rejection_counts_what_is_dispatched_to_a_node_and_not_joined_yet() -> None:
    # Early rejection ("slo") reads each decode node's outstanding load at arrival: its batch of
    # the moment plus the requests placed there that are still in prefill. Read without them
    # (before this test), every arrival of a prefill time went to the node that was least
    # loaded *now*, and each was let in on the same room: the herding of the overload report.
    c = make(admission="slo", num_prefill=1, num_decode=2, uniform_decode_s=100.0)
    c.decode_load("d0").expect("x", 0.0, 100, 10)
    c.on_decode_joined("d0", "x", 0.0)
    chosen = []
    for i, rid in enumerate(("a", "b", "c")):  # each a prefill of 0.2 s: none joins by 0.02
        d = placed(c.schedule(request(rid, first_key=100 * (i + 1)), 0.01 * i))
        chosen.append((d.decode_id, [e.batch_size for e in d.decode_candidates]))
    assert chosen == [("d1", [2, 1]), ("d0", [2, 2]), ("d1", [3, 2])]
    # One decode node, room for one request at the TBT SLO: b arrives while a is in prefill
    # (its join is predicted at 0.2) and is turned away at arrival, its prefill never spent.
    c = make(admission="slo", num_decode=1, tbt_slo_s=0.0115)
    placed(c.schedule(request("a", output_len=1000), 0.0))
    b = c.schedule(request("b", first_key=100, output_len=1000), 0.1)
    assert isinstance(b, Rejection) and b.reason is RejectReason.TBT_SLO
    assert b.predicted_tbt_s == pytest.approx(0.012)
    assert [e.batch_size for e in b.decode_candidates] == [2]
    # Once a is reported finished, its room is free again.
    assert isinstance(c.admit_decode("a", 0.2), type(None))
    c.on_decode_joined("d0", "a", 0.2)
    c.on_decode_finished("d0", "a", 0.3)
    placed(c.schedule(request("b", first_key=100, output_len=1000), 0.3))


def test_early_rejection_with_the_decode_check_after_prefill_rejects_the_wave_it_let_in() -> None:
    # Early rejection ("slo") lets b in at 0.1 on an empty decode node. A request it did not
    # place there (x, moved from elsewhere) joins before b's prefill ends: b would make the
    # step 0.012 s > 0.0115, so the check after prefill rejects it there, its prefill spent.
    for check, expected in ((True, Rejection), (False, type(None))):
        c = make(admission="slo", num_decode=1, tbt_slo_s=0.0115,
                 decode_check_after_prefill=check)
        placed(c.schedule(request("b", first_key=100, output_len=1000), 0.1))
        c.decode_load("d0").expect("x", 0.2, 100, 1000)
        c.on_decode_joined("d0", "x", 0.2)
        late = c.admit_decode("b", 0.4)
        assert isinstance(late, expected)
        if check:
            assert isinstance(late, Rejection) and late.reason is RejectReason.TBT_SLO
            assert late.predicted_tbt_s == pytest.approx(0.012)
            assert c.decode_load("d0").num_booked == 1  # b forgotten
    # Prediction-based early rejection (with t_d) sees the first one coming and stops the second
    # at arrival: nothing reaches the check after prefill to be rejected there.
    c = make(admission="early", num_decode=1, tbt_slo_s=0.0115, decode_check_after_prefill=True,
             uniform_decode_s=10.0)
    placed(c.schedule(request("a", output_len=1000), 0.0))
    assert isinstance(c.schedule(request("b", first_key=100, output_len=1000), 0.1), Rejection)


def test_uniform_decode_time_forecasts_every_request_to_finish_after_t_d() -> None:
    c = make(num_decode=1, uniform_decode_s=2.0)
    placed(c.schedule(request("a", output_len=10_000), 0.0))  # its length is not used
    c.on_decode_joined("d0", "a", 1.0)
    assert c.decode_load("d0").next_finish_after(1.0) == pytest.approx(3.0)
    assert c.decode_load("d0").batch_at(2.9)[0] == 1 and c.decode_load("d0").batch_at(3.0)[0] == 0


def test_with_t_d_the_load_of_the_moment_counts_requests_that_outlive_it() -> None:
    # a joined at 1 s with t_d = 2 s and is not reported finished at 5 s: it still decodes.
    # Early rejection on the load of the moment ("slo") and the check after prefill count it
    # (a second request would make the step 0.012 s > 0.0115); the prediction for a later
    # moment ("early") follows t_d, whose window for a ended at 3 s, and leaves it out.
    for admission, rejected in (("slo", True), ("early", False)):
        c = make(admission=admission, num_decode=1, tbt_slo_s=0.0115, uniform_decode_s=2.0)
        placed(c.schedule(request("a"), 0.0))
        c.on_decode_joined("d0", "a", 1.0)
        assert c.decode_load("d0").batch_now(5.0)[0] == 1
        assert c.decode_load("d0").batch_window(5.0, 5.2)[0] == 0
        decision = c.schedule(request("b", first_key=100), 5.0)
        assert isinstance(decision, Rejection) is rejected
    # a joined at 1 s and was reported finished at 1.5 s, early: the load of the moment (2 s)
    # has room, while the prediction for b's join at 2.2 s still counts a (its window runs to
    # 3 s): t_d's early finishers balance its late ones.
    for admission, rejected in (("slo", False), ("early", True)):
        c = make(admission=admission, num_decode=1, tbt_slo_s=0.0115, uniform_decode_s=2.0)
        placed(c.schedule(request("a"), 0.0))
        c.on_decode_joined("d0", "a", 1.0)
        c.on_decode_finished("d0", "a", 1.5)
        decision = c.schedule(request("b", first_key=100), 2.0)
        assert isinstance(decision, Rejection) is rejected
    c = make(admission="decode_after_prefill", num_decode=1, tbt_slo_s=0.0115,
             uniform_decode_s=2.0)
    placed(c.schedule(request("a"), 0.0))
    c.on_decode_joined("d0", "a", 1.0)
    placed(c.schedule(request("b", first_key=100), 5.0))
    assert isinstance(c.admit_decode("b", 5.2), Rejection)


def test_cpp_places_long_prompts_on_a_group_predicted_as_a_pipeline() -> None:
    c = make(num_prefill=5, cpp_min_tokens=3000, cpp_nodes=2, cpp_chunk_tokens=1000)
    assert c.cpp_groups == (("p0", "p1"), ("p2", "p3"))  # p4: the remainder, prefills alone
    busy(c, "p1", 2.0)
    long = placed(c.schedule(request("long", prompt_len=4000), 0.0))
    # Group (p0, p1) waits for p1's 2 s; (p2, p3) is idle: 4 chunks on 2 nodes take 5/8 of 4 s.
    assert long.prefill_group == ("p2", "p3") and long.prefill_id == "p2"
    assert long.chosen.prefill_s == pytest.approx(4.0 * (4 + 2 - 1) / (4 * 2))
    assert [cand.instance_id for cand in long.prefill_candidates] == ["p0", "p2"]
    assert c.queue_s("p2", 0.0) == c.queue_s("p3", 0.0) == pytest.approx(2.5)
    short = placed(c.schedule(request("short", prompt_len=200, first_key=500), 0.0))
    assert short.prefill_group == () and short.prefill_id in ("p0", "p4")
    c.on_prefill_started("p2", "long", 0.0)
    c.on_prefill_finished("p2", "long", 2.5)
    assert c.queue_s("p2", 2.5) == c.queue_s("p3", 2.5) == 0.0


def test_cpp_group_reuses_only_the_prefix_every_member_holds_and_aborts_free_all() -> None:
    c = make(num_prefill=2, cpp_min_tokens=3000, cpp_nodes=2, cpp_chunk_tokens=1000)
    c.on_blocks_stored("p0", range(100))
    d = placed(c.schedule(request("a", prompt_len=4000, num_keys=100), 0.0))
    # p1 lacks the blocks: the group fetches them to itself (any remote prefix is fetched).
    assert d.prefill_group == ("p0", "p1") and d.fetch is not None and d.chosen.local_len == 0
    c.on_request_aborted("a")
    assert c.queue_s("p0", 0.0) == c.queue_s("p1", 0.0) == 0.0
    with pytest.raises(ValueError, match="cpp_nodes"):
        ConductorConfig(cpp_min_tokens=100, cpp_nodes=1)
    with pytest.raises(ValueError, match="1,000"):
        ConductorConfig(cpp_chunk_tokens=512)


def test_a_decode_instance_whose_kv_would_overflow_is_predicted_at_infinite_tbt() -> None:
    c = make(num_decode=2, decode_kv_capacity_tokens=500)  # each reserves 300 + 100
    first = placed(c.schedule(request("a", prompt_len=300, output_len=100), 0.0))  # 350 tokens
    second = placed(c.schedule(request("b", prompt_len=300, output_len=100, first_key=50), 0.0))
    assert first.decode_id != second.decode_id  # the other one would need 800 > 500
    rejection = c.schedule(request("c", prompt_len=300, output_len=100, first_key=90), 0.0)
    assert isinstance(rejection, Rejection) and rejection.reason is RejectReason.TBT_SLO
    assert rejection.predicted_tbt_s == float("inf")


def test_colocated_spreads_equal_ttft_requests_over_the_least_busy_decoders() -> None:
    c = make("colocated", num_prefill=3, num_decode=0)
    chosen = []
    for n in range(3):
        d = placed(c.schedule(request(f"r{n}", first_key=100 * n), 0.0))
        c.on_prefill_started(d.prefill_id, d.request_id, 0.0)
        c.on_prefill_finished(d.prefill_id, d.request_id, 0.0)  # queues empty again
        chosen.append(d.prefill_id)
    assert chosen == ["p0", "p1", "p2"]


def test_a_decode_node_reporting_more_kv_than_the_book_turns_the_request_away() -> None:
    # The book counts every request at the told output (1,000): a decodes, booked as 200 + 1,000
    # tokens. The node reports 1,500 held (a batch keeps its long outputs longest); with room for
    # 2,600, b (1,200 more) no longer fits and is rejected after prefill, where without the
    # report the book's 2,400 tokens fit.
    for reported, expected in ((None, DecodeEstimate), (1_500, Rejection)):
        c = make(admission="decode_after_prefill", num_decode=1, decode_kv_capacity_tokens=2_600)
        placed(c.schedule(request("a", output_len=1000), 0.0))
        assert isinstance(c.admit_decode("a", 0.2), DecodeEstimate)
        c.on_decode_joined("d0", "a", 0.2)
        if reported is not None:
            c.on_decode_kv("d0", reported)
            assert c.decode_load("d0").kv_undercount(500) == 300
        placed(c.schedule(request("b", first_key=100, output_len=1000), 0.2))
        assert isinstance(c.admit_decode("b", 0.4), expected)
    with pytest.raises(ValueError, match="reserved_tokens"):
        c.on_decode_kv("d0", -1)


def test_move_decode_moves_the_booking_to_the_node_that_takes_the_request() -> None:
    c = make(admission="decode_after_prefill", num_decode=2)
    a = placed(c.schedule(request("a"), 0.0))
    admitted = c.admit_decode("a", 0.2)
    assert isinstance(admitted, DecodeEstimate)
    other = "d1" if admitted.instance_id == "d0" else "d0"
    c.move_decode("a", other, 0.2)
    assert c.decode_load(other).num_booked == 1 and c.decode_load(admitted.instance_id).num_booked == 0
    c.on_decode_joined(other, "a", 0.2)
    assert c.decode_load(other).batch_size == 1 and a.request_id == "a"


def test_a_learned_prefill_speed_prices_an_instance_as_it_runs() -> None:
    """prefill_speed_weight: a colocated instance whose prefills take twice the fit is priced
    so; the queue of a prefill running past its fitted time is not empty."""
    conductor = make("colocated", num_prefill=2, num_decode=0, admission="none",
                     prefill_speed_weight=0.5)
    first = placed(conductor.schedule(request("a", 1000), 0.0))
    assert first.prefill_id == "p0" and first.predicted_ttft_s == pytest.approx(1.0)
    conductor.on_prefill_started("p0", "a", 0.0)
    conductor.on_prefill_finished("p0", "a", 1.5)  # 1.5 s for 1 s fitted: speed 1.5
    assert conductor.prefill_queue("p0").speed == 1.5
    # Both idle, no shared prefix: p0 is priced at 1.5x the fit, so p1 (at the fit) wins.
    second = placed(conductor.schedule(request("b", 1000, first_key=100), 2.0))
    assert second.prefill_id == "p1" and second.predicted_ttft_s == pytest.approx(1.0)
    by_id = {c.instance_id: c for c in second.prefill_candidates}
    assert by_id["p0"].prefill_s == pytest.approx(1.5) and by_id["p1"].prefill_s == 1.0
    # b runs on p1 at the fit; c (0.8 s fitted) costs 1.2 s on idle p0, 0.5 + 0.8 s on p1.
    conductor.on_prefill_started("p1", "b", 2.0)
    assert conductor.queue_s("p1", 2.5) == pytest.approx(0.5)
    third = placed(conductor.schedule(request("c", 800, first_key=200), 2.5))
    assert third.prefill_id == "p0" and third.predicted_ttft_s == pytest.approx(1.2)
    assert conductor.queue_s("p0", 2.5) == pytest.approx(1.2)  # its fitted 0.8 s at 1.5x
    conductor.on_prefill_started("p0", "c", 2.5)
    assert conductor.queue_s("p0", 3.5) == pytest.approx(0.2)  # 1 s of 1.2 s gone


def test_without_a_speed_weight_the_fit_is_kept() -> None:
    conductor = make("colocated", num_prefill=2, num_decode=0, admission="none")
    placed(conductor.schedule(request("a", 1000), 0.0))
    conductor.on_prefill_started("p0", "a", 0.0)
    conductor.on_prefill_finished("p0", "a", 2.0)
    assert conductor.prefill_queue("p0").speed == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_a_speed_weight_outside_0_1_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ValueError, match=r"^prefill_speed_weight must be in \[0, 1\]"):
        ConductorConfig(prefill_speed_weight=bad)


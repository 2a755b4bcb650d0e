"""Decisions as plain data: a Placement's candidate breakdown, built on first access, behaves
exactly like one passed to the constructor; the Conductor asks its models no more than needed."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import random

import pytest

from kvcake.conductor import (
    Conductor,
    ConductorConfig,
    DecodeStepPredictor,
    Placement,
    PrefillTimePredictor,
    Rejection,
    ScheduleRequest,
    freeze_heap,
)

BS = 16


class CountingPrefill:
    """prefill_s = (n - p) / 1000, counting the questions asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def predict(self, input_len: int, prefix_len: int) -> float:
        self.calls.append((input_len, prefix_len))
        return (input_len - prefix_len) / 1000


class CountingDecode:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def decode_step_time_s(self, batch_size: int, context_tokens: int) -> float:
        self.calls.append((batch_size, context_tokens))
        return 0.01 + 0.001 * batch_size


def make(**overrides: object) -> tuple[Conductor, CountingPrefill, CountingDecode]:
    prefill, decode = CountingPrefill(), CountingDecode()
    settings: dict[str, object] = dict(transfer_bandwidth_bytes_per_s=1e7, tbt_slo_s=1.0)
    settings.update(overrides)
    conductor = Conductor(ConductorConfig.from_dict(settings), ["p0", "p1", "p2"], ["d0", "d1"],
                          prefill, decode, 1000)
    conductor.on_blocks_stored("p0", range(8))
    conductor.on_blocks_stored("store", range(10))
    return conductor, prefill, decode


def request(rid: str, first_key: int = 0) -> ScheduleRequest:
    return ScheduleRequest(rid, 200, tuple(range(first_key, first_key + 12)), BS, 10)


def eager(p: Placement) -> Placement:
    return Placement(**{f.name: getattr(p, f.name) for f in dataclasses.fields(Placement)})


def test_a_placement_reads_like_one_built_with_its_candidates() -> None:
    conductor, _, _ = make()
    p = conductor.schedule(request("r"), 0.0)
    assert isinstance(p, Placement)
    assert repr(p) == repr(eager(p)) and p == eager(p) and hash(p) == hash(eager(p))
    assert [(c.instance_id, c.local_len, c.prefix_len, c.transfer_s) for c in p.prefill_candidates] \
        == [("p0", 128, 128, 0.0), ("p1", 0, 160, 0.016), ("p2", 0, 160, 0.016)]
    assert p.chosen == p.prefill_candidates[1] and p.chosen.instance_id == p.prefill_id == "p1"
    assert type(p.prefill_candidates) is tuple


def test_an_unread_placement_pickles_compares_and_replaces_like_a_plain_one() -> None:
    conductor, _, _ = make()
    p = conductor.schedule(request("r"), 0.0)
    assert isinstance(p, Placement)
    copy = pickle.loads(pickle.dumps(p))  # before anything read the candidates
    assert copy == p and copy.prefill_candidates == p.prefill_candidates
    assert dataclasses.replace(p, decode_id="d9").prefill_candidates == p.prefill_candidates
    assert dataclasses.asdict(p)["prefill_candidates"][1] == tuple(p.prefill_candidates[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.prefill_candidates = ()  # type: ignore[misc]
    with pytest.raises(AttributeError, match="prefil_candidates"):
        p.prefil_candidates  # type: ignore[attr-defined]  # noqa: B018


def test_a_rejection_carries_a_plain_candidate_tuple() -> None:
    conductor, _, _ = make(ttft_slo_s=1e-6)
    r = conductor.schedule(request("r"), 0.0)
    assert isinstance(r, Rejection)
    assert type(r.prefill_candidates) is tuple
    assert [c.instance_id for c in r.prefill_candidates] == ["p0", "p1", "p2"]


def test_models_are_asked_each_question_once() -> None:
    conductor, prefill, decode = make(index_on_placement=False)
    first = conductor.schedule(request("a"), 0.0)
    asked = list(prefill.calls)
    assert sorted(asked) == [(200, 128), (200, 160)]  # one plan per distinct local prefix
    conductor.on_request_aborted("a")
    again = conductor.schedule(request("b"), 0.0)  # the same question: remembered answers
    assert prefill.calls == asked
    assert isinstance(first, Placement) and isinstance(again, Placement)
    assert again.decode_candidates == first.decode_candidates
    assert len(decode.calls) == 2  # one per decode instance, reused by the second decision


def test_fitted_predictors_give_the_same_answers_cached_or_not() -> None:
    prefill = PrefillTimePredictor(1, 1.0, [0.0, 0.001, -0.001])
    decode = DecodeStepPredictor([0.01, 0.001, 0.0])
    conductor = Conductor(ConductorConfig(tbt_slo_s=1.0), ["p0", "p1"], ["d0"], prefill, decode,
                          1000)
    for i in range(5):
        p = conductor.schedule(request(f"r{i}", first_key=100 * i), float(i))
        assert isinstance(p, Placement)
        assert p.chosen.prefill_s == prefill.predict(200, p.prefix_len)
        assert p.predicted_tbt_s == decode.decode_step_time_s(p.decode_candidates[0].batch_size,
                                                              p.decode_candidates[0].context_tokens)


def test_freeze_heap_freezes_what_is_alive() -> None:
    try:
        frozen = freeze_heap()
        assert frozen > 0 and frozen == gc.get_freeze_count()
        conductor, _, _ = make()
        assert isinstance(conductor.schedule(request("r"), 0.0), Placement)  # still works
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("fetch_only_if_faster", [False, True])
def test_the_choice_ranks_by_the_very_ttft_each_candidate_reports(
        fetch_only_if_faster: bool) -> None:
    """The prefill choice uses precomputed sums; they must be the same floats as `ttft_s`
    (summed in the same order), or a near-tie could go to a different instance."""
    rng = random.Random(11)
    prefill = PrefillTimePredictor(1, 1.0, [0.0013, 0.00071, -0.00069])
    conductor = Conductor(
        ConductorConfig(fetch_only_if_faster=fetch_only_if_faster,
                        transfer_bandwidth_bytes_per_s=1.1e6),
        [f"p{i}" for i in range(12)], ["d0"], prefill, DecodeStepPredictor([0.01, 0.001, 0.0]),
        777)
    for i in range(12):
        conductor.on_blocks_stored(f"p{i}", range(rng.randrange(0, 14)))
        conductor.prefill_queue(f"p{i}").add(f"busy{i}", rng.uniform(0.0, 0.3))
    num_turned_down = 0
    for n in range(20):
        prompt_len = rng.randrange(17, 230)
        req = ScheduleRequest(f"r{n}", prompt_len, tuple(range(-(-prompt_len // BS))), BS, 10)
        match = conductor.index.match(req.block_keys)
        candidates, ttfts = conductor._estimate_prefills(
            req, match, conductor._local_blocks(req, match), conductor._fetch_source(match),
            now_s=0.0)
        expanded = candidates.expand()
        assert ttfts == [c.ttft_s for c in expanded]
        assert [candidates[i] for i in range(len(candidates))] == list(expanded)
        best_len = min(match.best_blocks * BS, prompt_len - 1)
        num_turned_down += sum(best_len > 1.5 * c.local_len and c.prefix_len == c.local_len
                               for c in expanded)  # the threshold says fetch; they recompute
    assert (num_turned_down > 0) == fetch_only_if_faster

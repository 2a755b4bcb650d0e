"""A seeded, event-driven workload that drives the Conductor the way a caller does, and a
canonical text form of everything it answers: the golden record of its decisions.

Each scenario runs one policy / admission / model combination on a small busy cluster: prompts
share system and session prefixes (some with a partial last block), every placement is followed
by the reports a simulator would send (transfer done, prefill started / finished, blocks stored
and evicted from an LRU, decode joined / finished) at jittered times, a few requests are aborted,
the transfer bandwidth changes, and instances are removed and added mid-run. SLOs are tight
enough that some requests are rejected.

Each decision becomes one line: its request id, kind, the headline values, and a digest of every
public value it carries (both per-candidate breakdowns, the fetch plan; floats by `repr`, which
round-trips exactly). Every 20 decisions a state line digests the public load views
(`queue_s`, `inflight_bytes`, `DecodeLoad.batch_at`, index sizes).

Portability. The Conductor's own arithmetic is plain Python floats, bit-identical on every
x86-64 CPU; only numpy's least-squares fit of the *fitted* predictors is not (OpenBLAS picks
other kernels per CPU: relative differences ~1e-13). So a fitted scenario's record opens with the
predictors it ran with (`= prefill <json>`, `= decode <json>`, exact `repr` floats), the replay
runs on those recorded predictors, and every decision line is then compared exactly. The fresh
fit on this machine is checked separately against the recorded one at `FIT_RTOL` (each
coefficient within FIT_RTOL of the largest coefficient's magnitude), so a change to the fit
itself still fails the record.

`tests/conductor/golden_decisions.txt` was recorded with this module on the Conductor as it was
before the decision-latency work (commit 4e1fd39); `test_golden.py` compares it. To record it
again (only for an intended change of decisions, and say so in the commit), on any machine:

    .venv/bin/python -m tests.conductor.golden_workload > /tmp/golden.txt
    mv /tmp/golden.txt tests/conductor/golden_decisions.txt

(through a temporary file: the recorder reads the old record and keeps its fit where this
machine's fit matches it at FIT_RTOL), then read the diff: the lines that change are the
decisions that changed.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcake.conductor import (
    Conductor,
    ConductorConfig,
    CostModel,
    Decision,
    DecodePoint,
    DecodeStepPredictor,
    Placement,
    PrefillTimePredictor,
    profile_grid,
)
from kvcake.conductor import ScheduleRequest as Req

BLOCK_SIZE = 16
STORE = "store"


@dataclass(frozen=True)
class Scenario:
    name: str
    config: dict[str, object]
    num_prefill: int = 8
    num_decode: int = 6
    max_blocks: int = 24
    num_requests: int = 300
    fitted: bool = False  # fitted predictors (as the live cluster) instead of the cost model
    interval_s: float = 0.004
    seed: int = 1


SCENARIOS = (
    Scenario("global_early", dict(policy="global_cache", admission="early", ttft_slo_s=0.03,
                                  tbt_slo_s=0.01092)),
    Scenario("global_slo_fitted_fetch_if_faster",
             dict(policy="global_cache", admission="slo", ttft_slo_s=0.035, tbt_slo_s=0.0109,
                  fetch_only_if_faster=True, index_on_placement=False,
                  transfer_bandwidth_bytes_per_s=2e10), fitted=True, seed=2),
    Scenario("global_none_wide", dict(policy="global_cache", admission="none",
                                      kvcache_balancing_threshold=2.0),
             num_prefill=40, num_decode=12, max_blocks=64, num_requests=150, interval_s=0.003,
             seed=3),
    Scenario("local_cache_early", dict(policy="local_cache", admission="early", ttft_slo_s=0.03,
                                       tbt_slo_s=0.01093), seed=4),
    Scenario("load_balance_slo", dict(policy="load_balance", admission="slo", tbt_slo_s=0.0109),
             fitted=True, seed=5),
    Scenario("random_early", dict(policy="random", admission="early", seed=7), seed=6),
    Scenario("colocated_early", dict(policy="colocated", admission="early", ttft_slo_s=0.035,
                                     tbt_slo_s=0.01093), num_decode=0, seed=8),
)


FIT_RTOL = 1e-9  # a fresh fit's predictions vs the recorded fit's, relative
FIT_FLOOR_S = 1e-6  # predictions below a microsecond are compared at FIT_RTOL of this

Fit = tuple[PrefillTimePredictor, DecodeStepPredictor]
DECODE_GRID = tuple((b, c) for b in (1, 8, 32) for c in (1000, 20000, 200000))


def _cost() -> CostModel:
    # The bare roofline: the scenarios' SLOs are sized to it (the calibrated profile's 25 ms step
    # overhead would reject every request).
    return CostModel.from_spec("llama3-70b@a800x8-roofline")


def fit_predictors() -> Fit:
    """The fitted predictors of the live cluster, fitted on this machine (BLAS-dependent bits)."""
    cost = _cost()
    prefill = PrefillTimePredictor.fit(profile_grid(cost, 64 * BLOCK_SIZE))
    decode = DecodeStepPredictor.fit(DecodePoint(b, c, cost.decode_step_time_s(b, c))
                                     for b, c in DECODE_GRID)
    return prefill, decode


def fit_mismatches(recorded: Fit, fresh: Fit) -> list[str]:
    """Profile points where `fresh` predicts other than `recorded` beyond FIT_RTOL.

    Compared on the points the fit is made on (not coefficient by coefficient: some are ~1e-17
    noise, and their units differ), each at FIT_RTOL of max(|recorded|, FIT_FLOOR_S).
    """
    pairs = [(f"prefill({p.input_len}, {p.prefix_len})",
              recorded[0].predict(p.input_len, p.prefix_len),
              fresh[0].predict(p.input_len, p.prefix_len))
             for p in profile_grid(_cost(), 64 * BLOCK_SIZE)]
    pairs += [(f"decode({b}, {c})", recorded[1].decode_step_time_s(b, c),
               fresh[1].decode_step_time_s(b, c)) for b, c in DECODE_GRID]
    return [f"{where}: {have!r} s, recorded fit {want!r} s" for where, want, have in pairs
            if not abs(have - want) <= FIT_RTOL * max(abs(want), FIT_FLOOR_S)]


def _models(fit: Fit | None) -> tuple[object, object, int]:
    cost = _cost()
    if fit is None:
        return cost, cost, cost.model.kv_bytes_per_token
    return fit[0], fit[1], cost.model.kv_bytes_per_token


def canonical(decision: Decision) -> str:
    """Every public value of a decision, in a fixed order (floats by exact `repr`)."""
    prefills = [(c.instance_id, c.local_len, c.prefix_len, c.transfer_s, c.queue_s, c.prefill_s,
                 c.ttft_s) for c in decision.prefill_candidates]
    decodes = [(d.instance_id, d.batch_size, d.context_tokens, d.tbt_s)
               for d in decision.decode_candidates]
    if isinstance(decision, Placement):
        f = decision.fetch
        fetch = None if f is None else (f.source, f.keys, f.start_len, f.end_len, f.num_bytes,
                                        f.transfer_s, f.num_tokens)
        head: tuple[object, ...] = (
            "P", decision.request_id, decision.prefill_id, decision.decode_id, decision.prefix_len,
            fetch, decision.predicted_ttft_s, decision.predicted_tbt_s, tuple(decision.chosen))
    else:
        head = ("R", decision.request_id, str(decision.reason), decision.retry_after_s,
                decision.predicted_ttft_s, decision.predicted_tbt_s)
    return repr((head, prefills, decodes))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def summary(decision: Decision) -> str:
    sha = _digest(canonical(decision))
    if isinstance(decision, Placement):
        return (f"{decision.request_id} P {decision.prefill_id} {decision.decode_id} "
                f"{decision.prefix_len} {decision.predicted_ttft_s!r} "
                f"{decision.predicted_tbt_s!r} {sha}")
    return (f"{decision.request_id} R {decision.reason} {decision.retry_after_s!r} "
            f"{decision.predicted_ttft_s!r} {sha}")


def _state(c: Conductor, now_s: float) -> str:
    parts: list[object] = [len(c.index), c.index.holders]
    for p in c.prefill_ids:
        parts.append((p, c.queue_s(p, now_s), len(c.prefill_queue(p)), c.inflight_bytes(p),
                      c.index.num_keys(p)))
    for d in c.decode_ids:
        load = c.decode_load(d)
        parts.append((d, load.batch_at(now_s), load.batch_at(now_s + 1.0), load.num_booked,
                      load.next_finish_after(now_s)))
    parts.append((c.inflight_bytes(STORE), c.index.num_keys(STORE)))
    return f"@ {now_s!r} {_digest(repr(parts))}"


class _Driver:
    """The caller: reports what happens to placed requests, at jittered predicted times."""

    def __init__(self, s: Scenario, fit: Fit | None = None) -> None:
        """`fit`: the predictors of a fitted scenario (default: fitted afresh on this machine)."""
        if s.fitted and fit is None:
            fit = fit_predictors()
        prefill, decode, kv_bytes = _models(fit if s.fitted else None)
        self.s, self.rng = s, random.Random(s.seed)
        prefill_ids = [f"p{i}" for i in range(s.num_prefill)]
        decode_ids = [f"d{i}" for i in range(s.num_decode)]
        self.c = Conductor(ConductorConfig.from_dict(s.config), prefill_ids, decode_ids,
                           prefill, decode, kv_bytes)  # type: ignore[arg-type]
        self.events: list[tuple[float, int, str, str, Placement]] = []
        self.seq = 0
        self.dead: set[str] = set()  # requests aborted: the caller reports nothing more
        self._keys: dict[str, tuple[Hashable, ...]] = {}
        self.lru: dict[str, OrderedDict[Hashable, None]] = {}
        self.next_key = 10_000
        self.sessions = [self._fresh(self.rng.randint(2, s.max_blocks // 2)) for _ in range(30)]
        for session in self.sessions[:20]:
            self._store(self.rng.choice(prefill_ids), session)
            if self.rng.random() < 0.4:
                self._store(STORE, session)

    def _fresh(self, n: int) -> list[int]:
        self.next_key += n
        return list(range(self.next_key - n, self.next_key))

    def _store(self, holder: str, keys: Sequence[Hashable]) -> None:
        capacity = 2000 if holder == STORE else 40 + 10 * self.s.max_blocks
        lru = self.lru.setdefault(holder, OrderedDict())
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        evicted = [lru.popitem(last=False)[0] for _ in range(len(lru) - capacity)]
        self.c.on_blocks_stored(holder, keys)
        if evicted:
            self.c.on_blocks_removed(holder, evicted)

    def _push(self, at_s: float, kind: str, holder: str, p: Placement) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at_s, self.seq, kind, holder, p))

    def request(self, i: int) -> Req:
        rng = self.rng
        base = rng.choice(self.sessions)
        keep = rng.randint(0, min(len(base), self.s.max_blocks - 1))
        keys = base[:keep] + self._fresh(rng.randint(1, self.s.max_blocks - keep))
        if rng.random() < 0.1:
            self.sessions.append(keys)
        prompt_len = len(keys) * BLOCK_SIZE - (rng.randrange(BLOCK_SIZE) if rng.random() < 0.5
                                               else 0)
        return Req(f"r{i}", prompt_len, tuple(keys), BLOCK_SIZE, rng.choice((16, 64, 256)))

    def placed(self, p: Placement, now_s: float) -> None:
        rng = self.rng
        chosen = p.chosen
        start_s = now_s + chosen.transfer_s * rng.uniform(0.8, 1.3) + chosen.queue_s
        if p.fetch is not None:
            self._push(now_s + p.fetch.transfer_s * rng.uniform(0.8, 1.3), "transfer", "", p)
        self._push(start_s, "start", p.prefill_id, p)
        end_s = start_s + chosen.prefill_s * rng.uniform(0.7, 1.4)
        self._push(end_s, "finish", p.prefill_id, p)
        join_s = end_s + rng.uniform(0.0, 0.01)
        self._push(join_s, "join", p.decode_id, p)
        num_out = p.decode_candidates[0].batch_size  # any int; only spreads the finish times
        self._push(join_s + (32 + num_out) * p.predicted_tbt_s * rng.uniform(0.8, 1.5),
                   "done", p.decode_id, p)
        if rng.random() < 0.04:
            self._push(now_s + rng.uniform(0.0, 2.0), "abort", "", p)

    def report(self, at_s: float, kind: str, holder: str, p: Placement) -> None:
        c, rid = self.c, p.request_id
        if rid in self.dead:
            return
        if kind == "transfer":
            c.on_transfer_done(rid, at_s)
        elif kind == "start":
            c.on_prefill_started(holder, rid, at_s)
        elif kind == "finish":
            c.on_prefill_finished(holder, rid, at_s)
            self._store(holder, list(self._keys[rid]))
            if self.rng.random() < 0.3:
                self._store(STORE, list(self._keys[rid]))
        elif kind == "join":
            c.on_decode_joined(holder, rid, at_s)
        elif kind == "done":
            c.on_decode_finished(holder, rid, at_s)
        else:
            c.on_request_aborted(rid)
            self.dead.add(rid)

    def admin(self, i: int, now_s: float) -> None:
        """Cluster changes a live deployment sees: bandwidth, an instance lost, one added."""
        n, c = self.s.num_requests, self.c
        if i == n // 3:
            c.set_transfer_bandwidth(c.config.transfer_bandwidth_bytes_per_s / 2)
        elif i == n // 2:
            lost = c.prefill_ids[1]
            for _, _, _, _, p in self.events:
                if lost in (p.prefill_id, p.decode_id) and p.request_id not in self.dead:
                    c.on_request_aborted(p.request_id)
                    self.dead.add(p.request_id)
            c.remove_instance(lost)
        elif i == 2 * n // 3:
            c.add_prefill_instance("p-new")
            c.add_decode_instance("p-new" if c.config.policy == "colocated" else "d-new")

    def run(self) -> Iterator[str]:
        now_s = 0.0
        for i in range(self.s.num_requests):
            now_s += self.rng.expovariate(1.0 / self.s.interval_s)
            while self.events and self.events[0][0] <= now_s:
                self.report(*self._pop())
            self.admin(i, now_s)
            req = self.request(i)
            self._keys[req.request_id] = req.block_keys
            decision = self.c.schedule(req, now_s)
            yield summary(decision)
            if isinstance(decision, Placement):
                self.placed(decision, now_s)
            if i % 20 == 19:
                yield _state(self.c, now_s)

    def _pop(self) -> tuple[float, str, str, Placement]:
        at_s, _, kind, holder, p = heapq.heappop(self.events)
        return at_s, kind, holder, p


@dataclass(frozen=True)
class Section:
    """One scenario of the record: the predictors it ran with (fitted only) and its lines."""

    fit: Fit | None
    lines: tuple[str, ...]


def record(previous: dict[str, Section] | None = None) -> Iterator[str]:
    """The record's lines. A fitted scenario keeps `previous`'s fit when this machine's fit
    matches it at FIT_RTOL, so re-recording on another CPU changes only what really changed."""
    previous = previous or {}
    for s in SCENARIOS:
        yield f"# {s.name}"
        fit = fit_predictors() if s.fitted else None
        kept = previous[s.name].fit if s.name in previous else None
        if fit is not None and kept is not None and not fit_mismatches(kept, fit):
            fit = kept
        if fit is not None:
            yield f"= prefill {fit[0].to_json()}"
            yield f"= decode {fit[1].to_json()}"
        yield from _Driver(s, fit).run()


def parse_record(text: str) -> dict[str, Section]:
    """The record's sections by scenario name; ValueError naming the line if it is malformed."""
    raw: dict[str, tuple[dict[str, str], list[str]]] = {}
    current: tuple[dict[str, str], list[str]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("# "):
            current = raw.setdefault(line[2:], ({}, []))
        elif current is None:
            raise ValueError(f"golden record line {number}: expected '# <scenario>' first")
        elif line.startswith("= "):
            kind, _, payload = line[2:].partition(" ")
            if kind not in ("prefill", "decode"):
                raise ValueError(f"golden record line {number}: unknown predictor {kind!r}")
            current[0][kind] = payload
        else:
            current[1].append(line)
    sections = {}
    for name, (fits, lines) in raw.items():
        fit = None
        if fits:
            if set(fits) != {"prefill", "decode"}:
                raise ValueError(f"golden record scenario {name}: needs both '= prefill' and "
                                 f"'= decode' lines, got {sorted(fits)}")
            fit = (PrefillTimePredictor.from_json(fits["prefill"]),
                   DecodeStepPredictor.from_json(fits["decode"]))
        sections[name] = Section(fit, tuple(lines))
    return sections


def first_difference(expected: Sequence[str], got: Sequence[str]) -> str | None:
    """None if the lines are identical; else where and how they first differ."""
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if have != want:
            return f"line {i}: got {have!r}, recorded {want!r}"
    if len(got) != len(expected):
        return f"{len(got)} lines, recorded {len(expected)}"
    return None


if __name__ == "__main__":
    _golden = Path(__file__).with_name("golden_decisions.txt")
    for line in record(parse_record(_golden.read_text()) if _golden.exists() else None):
        print(line)

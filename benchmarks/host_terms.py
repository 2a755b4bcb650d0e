"""The live profile's host terms measured from one live step trace, and the live decode batch over
time next to the simulated one (issue 11 part 3; read by `sim_vs_live.py --host-terms/--batch-series`).

Input: a `decode_gaps.py --save PREFIX` file (the decode worker's steps, the workers' CPU
sampled every 20 ms, the requests as the client saw them; times from the replay's start).
Measured, not fitted to a metric the check compares:
- `decode_step_overhead_s`: the decode worker's time from one engine step's end to the next
  one's start, back-to-back steps (sending the step's tokens, its loop), mean;
- `contention.decode` / `contention.decode_prefill_busy`: the engine steps' wall time over the
  isolated 1-thread step fit (`decode_refit.json`) at each step's own batch and context, summed
  over the steps with the prefill worker idle / computing (`CpuActivity`: its sampled CPU above
  half a core over the step; without samples `FifoActivity`: its prefills reconstructed from the
  requests, first come first served, each ending at its first token);
- `contention.prefill` / `contention.prefill_decode_busy`: the prefills of requests that
  reached an idle prefill worker (the busy span that follows, or the request's TTFT), over the
  prefill fit of that prompt, median ratio, of those the decode worker stepped through for less /
  more than half of their time (one class only: `prefill` from it, no busy factor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvcake.bench.stats import Outcome, RequestResult
from kvcake.conductor import DecodeStepPredictor, PrefillTimePredictor
from kvcake.sim.config import SimConfig
from kvcake.sim.decode import DecodeInstance
from kvcake.sim.run import simulate
from kvcake.sim.trace import Trace

# cores: the prefill worker computes. /proc counts CPU in 10 ms ticks, so a 20 ms sample
# interval reads 0, ~0.5 or ~1 core; a worker sharing its core under load reads ~0.5 while it
# computes, an idle one 0: any tick in the interval counts
BUSY = 0.25
HOLE = 2  # sample intervals without a tick that a busy span may hold (the worker descheduled)
GAP_S = 0.05  # steps further apart than this were not back to back
BATCH_BANDS = ((1, 4), (5, 8), (9, 16), (17, 10**9))  # for wall / fit by batch


def _samples(cpu: list[list[Any]], role: str) -> tuple[np.ndarray, np.ndarray]:
    """(sample times, cumulative CPU seconds) of `role`."""
    pts = [(t, c[role]) for t, c in cpu if role in c]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def _rates(cpu: list[list[Any]], role: str) -> tuple[np.ndarray, np.ndarray]:
    """(midpoint times, cores used) of the intervals between consecutive samples of `role`."""
    t, c = _samples(cpu, role)
    return (t[1:] + t[:-1]) / 2, np.diff(c) / np.maximum(np.diff(t), 1e-9)


def _share(mid: np.ndarray, rate: np.ndarray, t0: float, t1: float) -> float | None:
    inside = (mid >= t0) & (mid <= t1)
    if inside.any():
        return float(rate[inside].mean())
    if not len(mid) or t0 < mid[0] or t1 > mid[-1]:
        return None
    return float(rate[np.searchsorted(mid, t0)])


class CpuActivity:
    """When the prefill worker computed, from its sampled CPU (above BUSY cores)."""

    source = "cpu"

    def __init__(self, saved: dict[str, Any]) -> None:
        self.mid, self.rate = _rates(saved["cpu"], "prefill")
        self.times, _ = _samples(saved["cpu"], "prefill")
        self.sends = sorted(r["send_at_s"] for r in saved["requests"])

    def busy(self, t0: float, t1: float) -> bool | None:
        share = _share(self.mid, self.rate, t0, t1)
        return None if share is None else share >= BUSY

    def spans(self, requests: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
        """(request, seconds) of the busy spans that start after a request reached an idle
        prefill worker and hold no other request's arrival."""
        mid, rate, times, out = self.mid, self.rate, self.times, []
        for r in requests:
            sent = r["send_at_s"]
            if self.busy(sent - 0.1, sent) is not False:
                continue  # the prefill worker was busy (or unsampled): this one queued
            after = np.nonzero((mid > sent) & (rate >= BUSY))[0]
            if not len(after):
                continue
            start = end = int(after[0])
            while True:
                ahead = [k for k in range(end + 1, min(end + 2 + HOLE, len(mid)))
                         if rate[k] >= BUSY]
                if not ahead:
                    break
                end = ahead[0]
            if any(sent < t <= times[end + 1] for t in self.sends):
                continue  # another request arrived meanwhile: the span may hold two prefills
            out.append((r, float(times[end + 1] - times[start])))  # the intervals' edges
        return out


class FifoActivity:
    """When the prefill worker computed, from the requests as the client saw them (where no
    CPU samples exist): one prefill worker serves them first come first served, so request i's
    prefill runs from max(its arrival, request i-1's first token) to its own first token (its
    TTFT; the hand-off and the frontend's few ms included)."""

    source = "requests"

    def __init__(self, saved: dict[str, Any]) -> None:
        self.windows: list[tuple[float, float, dict[str, Any]]] = []
        free = -np.inf
        for r in sorted(saved["requests"], key=lambda r: r["send_at_s"]):
            if r.get("ttft_s") is None:
                continue
            start, end = max(r["send_at_s"], free), r["send_at_s"] + r["ttft_s"]
            self.windows.append((start, end, r))
            free = end

    def busy(self, t0: float, t1: float) -> bool | None:
        inside = sum(max(0.0, min(t1, e) - max(t0, s)) for s, e, _ in self.windows)
        return inside >= BUSY * (t1 - t0)

    def spans(self, requests: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
        """(request, seconds) of the prefills that started at their request's arrival."""
        return [(r, e - s) for s, e, r in self.windows if s == r["send_at_s"]]


def activity(saved: dict[str, Any]) -> CpuActivity | FifoActivity:
    has_cpu = any("prefill" in c for _, c in saved["cpu"])
    return CpuActivity(saved) if has_cpu else FifoActivity(saved)


def measure(saved: dict[str, Any], decode_fit: DecodeStepPredictor,
            prefill_fit: PrefillTimePredictor) -> dict[str, Any]:
    steps = [s for s in saved["steps"] if s["rows"] and s["t0"] >= 0]
    prefill = activity(saved)
    wall = {"idle": 0.0, "busy": 0.0}
    fit = {"idle": 0.0, "busy": 0.0}
    count = {"idle": 0, "busy": 0}
    by_batch: dict[str, list[float]] = {}  # "idle 1-4": [wall, fit]: does the fit's shape hold?
    ratios: dict[str, list[float]] = {"idle": [], "busy": []}
    for s in steps:
        busy = prefill.busy(s["t0"], s["t1"])
        if busy is None:
            continue
        key = "busy" if busy else "idle"
        batch = len(s["rows"])
        step_fit = decode_fit.decode_step_time_s(batch, sum(n for _, n in s["rows"]))
        wall[key] += s["t1"] - s["t0"]
        fit[key] += step_fit
        count[key] += 1
        ratios[key].append((s["t1"] - s["t0"]) / max(step_fit, 1e-9))
        label = f"{key} {next(b for b in BATCH_BANDS if batch <= b[1])}"
        acc = by_batch.setdefault(label, [0.0, 0.0, 0])
        acc[0] += s["t1"] - s["t0"]
        acc[1] += step_fit
        acc[2] += 1
    gaps = [b["t0"] - a["t1"] for a, b in zip(steps, steps[1:], strict=False)
            if 0 <= b["t0"] - a["t1"] < GAP_S]
    t0 = np.array([s["t0"] for s in steps])
    t1 = np.array([s["t1"] for s in steps])
    by_decode: dict[bool, list[float]] = {False: [], True: []}  # decode busy over the prefill?
    for r, span_s in prefill.spans(saved["requests"]):
        start = r["send_at_s"]  # (a CPU span starts within a sample or two of it)
        cover = float(np.clip(np.minimum(t1, start + span_s) - np.maximum(t0, start), 0, None)
                      .sum()) / max(span_s, 1e-9)
        by_decode[cover >= BUSY].append(
            span_s / max(1e-9, prefill_fit.predict(r["prompt_len"], 0)))
    spans = by_decode[False] + by_decode[True]
    idle_spans, busy_spans = by_decode[False], by_decode[True]
    # each step's wall / fit over its class's factor: the dispersion around the mean model
    spread = [r * fit[k] / wall[k] for k, rs in ratios.items() if wall[k] for r in rs]
    return {"decode_step_overhead_s": float(np.mean(gaps)) if gaps else 0.0,
            "step_jitter_quantiles": (np.percentile(spread, np.arange(1, 100)).round(4).tolist()
                                      if spread else None),
            "contention": {"decode": wall["idle"] / fit["idle"] if fit["idle"] else 1.0,
                           "decode_prefill_busy": (wall["busy"] / fit["busy"] if fit["busy"]
                                                   else None),
                           # one class measured only: one factor, no coupling
                           "prefill": (float(np.median(idle_spans or busy_spans)) if spans
                                       else 1.0),
                           "prefill_decode_busy": (float(np.median(busy_spans))
                                                   if idle_spans and busy_spans else None)},
            "evidence": {"prefill_activity_from": prefill.source,
                         "steps_idle": count["idle"], "steps_busy": count["busy"],
                         "wall_over_fit_by_batch": {k: [round(w / f, 3), n] for k, (w, f, n)
                                                    in sorted(by_batch.items())},
                         "back_to_back_gaps": len(gaps), "prefill_spans": len(spans),
                         "prefill_spans_decode_idle_busy": [len(idle_spans), len(busy_spans)],
                         "prefill_span_ratios_p25_p75": (np.percentile(spans, [25, 75]).tolist()
                                                         if spans else None)}}


def jittered_tbts(states: list[Any], quantiles: list[float] | None,
                  seed: int = 0) -> list[float | None]:
    """Each simulated request's paper TBT (mean of its slowest 10% of gaps) with every gap
    multiplied by a draw (seeded) from the live steps' measured dispersion around the mean
    model (`step_jitter_quantiles`: wall / fit over the class factor, 1st..99th percentile);
    the simulator's steps are the model's means, so their gaps have no such spread. None for a
    request without gaps; without quantiles, the plain TBT."""
    rng = np.random.default_rng(seed)
    out: list[float | None] = []
    for s in states:
        if s.gaps.num_gaps == 0:
            out.append(None)
            continue
        gaps = s.gaps.gaps()
        if quantiles:
            gaps = gaps * rng.choice(np.asarray(quantiles), size=len(gaps))
        k = max(1, int(np.ceil(0.1 * len(gaps))))
        out.append(float(np.sort(gaps)[-k:].mean()))
    return out


def with_terms(profile: dict[str, Any], terms: dict[str, Any]) -> dict[str, Any]:
    """The live profile with the measured host terms (the busy factor only where measured)."""
    contention = {k: round(v, 4) for k, v in terms["contention"].items() if v is not None}
    live = {**profile["live"], "contention": contention,
            "decode_step_overhead_s": round(terms["decode_step_overhead_s"], 6)}
    return {**profile, "live": live}


def _recording(runs: list[tuple[float, float, int, int]]) -> Any:
    """`DecodeInstance.on_step_done` that logs each finished run (start, end, steps, batch)."""
    original = DecodeInstance.on_step_done

    def on_step_done(self: DecodeInstance, now_s: float, token: int) -> Any:
        if token == self.token and self.run is not None and self.running:
            run = self.run
            runs.append((run.start_s, run.end_s, run.num_steps, len(self.running)))
        return original(self, now_s, token)
    return original, on_step_done


def batch_series(saved: dict[str, Any], trace: Trace, config: SimConfig, cost: Any,
                 bucket_s: float = 5.0) -> list[dict[str, float]]:
    """Per `bucket_s` of the replay: the live decode batch (step-weighted mean over the steps
    starting in it), its mean engine step + overhead, the prefill worker's busy share; the
    simulated batch, mean step and prefill busy share for the same requests."""
    runs: list[tuple[float, float, int, int]] = []
    original, recording = _recording(runs)
    DecodeInstance.on_step_done = recording  # type: ignore[method-assign]
    try:
        result = simulate(config, trace, cost)
    finally:
        DecodeInstance.on_step_done = original  # type: ignore[method-assign]
    steps = [s for s in saved["steps"] if s["rows"] and s["t0"] >= 0]
    prefill = activity(saved)
    sim_busy = [(s.prefill_start_s, s.prefill_start_s + s.prefill_s) for s in result.states
                if s.prefill_start_s is not None and s.prefill_done]
    end = max([s["t1"] for s in steps] + [r[1] for r in runs])
    rows = []
    for b in np.arange(0.0, end, bucket_s):
        live = [s for s in steps if b <= s["t0"] < b + bucket_s]
        # each simulated run's steps counted in the buckets they fall in (evenly spread)
        sim = [(n * overlap / (e - s0), bat, overlap) for s0, e, n, bat in runs
               if e > s0 and (overlap := min(e, b + bucket_s) - max(s0, b)) > 0]
        sim_steps = sum(x[0] for x in sim)
        busy_s = sum(max(0.0, min(e, b + bucket_s) - max(s, b)) for s, e in sim_busy)
        nxt = {id(a): c for a, c in zip(live, live[1:], strict=False)
               if c["t0"] - a["t1"] < GAP_S}  # back to back: the loop's time counts
        rows.append({
            "t_s": float(b),
            "live_batch": float(np.mean([len(s["rows"]) for s in live])) if live else 0.0,
            "sim_batch": sum(k * bat for k, bat, _ in sim) / sim_steps if sim_steps else 0.0,
            "live_step_ms": (1000 * float(np.mean([(nxt[id(s)]["t0"] if id(s) in nxt
                                                     else s["t2"]) - s["t0"] for s in live]))
                             if live else 0.0),
            "sim_step_ms": 1000 * sum(x[2] for x in sim) / sim_steps if sim_steps else 0.0,
            "live_prefill_busy": float(np.mean([bool(prefill.busy(t, t + 0.1)) for t in
                                                np.arange(b, b + bucket_s, 0.1)])),
            "sim_prefill_busy": busy_s / bucket_s})
    return rows


def print_series(rows: list[dict[str, float]]) -> None:
    print("| t (s) | batch live / sim | step incl. overhead (ms) live / sim | prefill busy live / sim |"
          "\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['t_s']:.0f} | {r['live_batch']:.1f} / {r['sim_batch']:.1f} | "
              f"{r['live_step_ms']:.1f} / {r['sim_step_ms']:.1f} | "
              f"{r['live_prefill_busy']:.2f} / {r['sim_prefill_busy']:.2f} |")


def results_of(saved: dict[str, Any]) -> list[RequestResult]:
    """The saved requests as the client's results (for the live metrics of that run)."""
    return [RequestResult(Outcome(r.get("outcome", "ok")), r["prompt_len"], len(r["gaps_s"]) + 1,
                          r["ttft_s"], tuple(r["gaps_s"])) for r in saved["requests"]]


def load_saved(path: Path) -> dict[str, Any]:
    import json

    data = json.loads(path.read_text())
    if "steps" not in data or "cpu" not in data:
        raise SystemExit(f"{path}: not a `decode_gaps.py --save` file")
    return data


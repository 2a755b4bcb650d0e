"""The colocated workers' step terms measured from a live step trace (issue 11 part 3; read by
`decode_gaps.py --systems colocated` and `sim_vs_live.py --colocated-terms`).

Input: a `decode_gaps.py --systems colocated --save PREFIX` file: every step of both colocated
workers (`worker`; `rows`: its decode rows `[request, context tokens]`, `chunks`: the prompt
chunks it computed beside them `[request, first position, tokens, prompt tokens]`; times from
the replay's start). Each step is priced as the simulator prices it (kvcake/sim/decode.py: a
mixed step = the decode step of its rows + each chunk's share by tokens of its prompt's prefill,
the prefix being the request's first chunk's start; a chunk-only step = the chunks' share), on
the isolated 1-thread fits (`decode_refit.json`, `prefill_refit.json`), and split by kind
(decode only / mixed / chunk only) and by whether the other worker stepped through more than
half of it. Measured, nothing fitted to a compared metric:
- per kind and class: steps, wall / CPU, wall summed over the price summed (the factor the live
  step takes over the simulator's sum of parts);
- the mixed steps' least-squares split `wall = a * decode part + b * chunk part + c` (is the
  live mixed step the sum of its parts?), evidence only (`measure` prices a mixed step's chunk
  by its own factor, `chunk_mixed`: a mixed step is cheaper than a decode-only step plus a
  chunk-only step, whose chunk factor carries a forward's fixed cost);
- `step_overhead_s`: from one step's end (its tokens sent) to the same worker's next start,
  back-to-back steps, mean;
- with `by_rows` (`sim_vs_live.py --colocated-by-rows`), the decode and mixed-chunk factors
  again per decode-row bucket (1, 2, 3, 4+ rows), each class apart (`row_factors`): the
  profile's `colocated.by_rows` table.

Minimum steps per bucket: `MIN_BUCKET_STEPS` = 100; a bucket with fewer keeps the pooled factor
(`null` in the table). Why 100: on the quiet 0.394 req/s colocated trace (2026-12-02) one step's
wall over its price spreads with a coefficient of variation of 0.12-0.22 for decode steps and
0.36-0.51 for a mixed step's chunk residual (buckets of 100 steps or more), so a bucket factor
from 100 steps has a standard error of about 2% (decode) and 4-5% (mixed chunk), under the 5-11%
by which the decode buckets differ. The buckets under 100 there have 0-14 steps: a handful of
step runs (consecutive steps share one batch and the other worker's activity), not independent
samples. The evidence lists each bucket's steps, factor and standard error (delta method, steps
taken as independent: a lower bound, and an understatement for the small buckets).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

GAP_S = 0.05  # a worker's steps further apart than this were not back to back
OTHER_BUSY = 0.5  # share of a step the other worker stepped through: "other busy"
ROW_BUCKETS = 4  # the by-rows table's buckets: 1, 2, 3 and 4+ decode rows
MIN_BUCKET_STEPS = 100  # fewer steps in a bucket: the pooled factor (module docstring: why)


def _overlap(intervals: np.ndarray, t0: float, t1: float) -> float:
    """Seconds of [t0, t1] inside the (sorted, disjoint) intervals."""
    if not len(intervals):
        return 0.0
    lo = max(0, int(np.searchsorted(intervals[:, 1], t0)))
    total = 0.0
    for a, b in intervals[lo:]:
        if a >= t1:
            break
        total += max(0.0, min(b, t1) - max(a, t0))
    return total


def priced(steps: list[dict[str, Any]], decode_fit: Any, prefill_fit: Any) -> list[dict[str, Any]]:
    """Each step with `kind`, `decode_s`, `chunk_s` (the simulator's price on the isolated fits),
    `chunk_tokens` and `other_busy` (the other worker's step time over the step's, 0..1)."""
    prefix: dict[str, int] = {}
    for s in sorted(steps, key=lambda s: s["t0"]):
        for rid, start, _, _ in s.get("chunks", []):
            prefix.setdefault(rid, start)
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        by_worker[s["worker"]].append(s)
    spans = {w: np.array(sorted((s["t0"], s["t1"]) for s in ss)) for w, ss in by_worker.items()}
    out = []
    for s in steps:
        rows, chunks = s["rows"], s.get("chunks", [])
        if not rows and not chunks:
            continue
        batch, context = len(rows), sum(n for _, n in rows)
        decode_s = decode_fit.decode_step_time_s(batch, context) if batch else 0.0
        chunk_s = 0.0
        for rid, _, n, prompt in chunks:
            new = prompt - prefix[rid]
            chunk_s += max(0.0, prefill_fit.predict(prompt, prefix[rid])) * n / max(1, new)
        wall = s["t1"] - s["t0"]
        others = [w for w in spans if w != s["worker"]]
        busy = sum(_overlap(spans[w], s["t0"], s["t1"]) for w in others)
        kind = "mixed" if rows and chunks else ("decode" if rows else "chunk")
        out.append({**s, "kind": kind, "decode_s": decode_s, "chunk_s": chunk_s,
                    "chunk_tokens": sum(c[2] for c in chunks), "wall": wall,
                    "other_busy": busy / max(wall, 1e-9)})
    return out


def overhead_s(steps: list[dict[str, Any]]) -> float | None:
    """Mean time from a step's end (its tokens sent) to the same worker's next step."""
    gaps = []
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        by_worker[s["worker"]].append(s)
    for ss in by_worker.values():
        ss = sorted(ss, key=lambda s: s["t0"])
        gaps += [b["t0"] - a["t1"] for a, b in zip(ss, ss[1:], strict=False)
                 if b["t0"] - a["t1"] < GAP_S]
    return float(np.mean(gaps)) if gaps else None


def summary(steps: list[dict[str, Any]], decode_fit: Any | None,
            prefill_fit: Any | None) -> dict[str, Any]:
    """Counts per worker and kind; with both fits the factors per kind and class (other worker
    idle / busy) and the mixed steps' split."""
    out: dict[str, Any] = {"steps": len(steps)}
    kinds: dict[str, int] = defaultdict(int)
    for s in steps:
        kinds["mixed" if s["rows"] and s.get("chunks") else
              "decode" if s["rows"] else "chunk" if s.get("chunks") else "empty"] += 1
    out["kinds"] = dict(kinds)
    busy = [s for s in steps if s["rows"] or s.get("chunks")]
    if busy:
        out["batch_mean"] = round(float(np.mean([len(s["rows"]) for s in busy])), 2)
        out["wall_over_cpu"] = round(sum(s["t1"] - s["t0"] for s in busy)
                                     / max(1e-9, sum(s["cpu"] for s in busy)), 3)
    oh = overhead_s(steps)
    out["step_overhead_ms"] = None if oh is None else round(1000 * oh, 3)
    if decode_fit is None or prefill_fit is None:
        return out
    return {**out, **measure_priced(priced(steps, decode_fit, prefill_fit))}


def measure_priced(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The factors per kind and class, and the mixed steps' least-squares split."""
    factors: dict[str, Any] = {}
    for kind in ("decode", "mixed", "chunk"):
        for cls, test in (("other_idle", lambda x: x < OTHER_BUSY),
                          ("other_busy", lambda x: x >= OTHER_BUSY)):
            group = [s for s in steps if s["kind"] == kind and test(s["other_busy"])]
            if not group:
                continue
            wall = sum(s["wall"] for s in group)
            price = sum(s["decode_s"] + s["chunk_s"] for s in group)
            factors[f"{kind}.{cls}"] = {"steps": len(group),
                                        "wall_over_price": round(wall / max(price, 1e-9), 4),
                                        "wall_over_cpu": round(wall / max(1e-9, sum(
                                            s["cpu"] for s in group)), 3),
                                        "wall_ms_p50": round(1000 * float(np.median(
                                            [s["wall"] for s in group])), 2)}
    out: dict[str, Any] = {"factors": factors}
    mixed = [s for s in steps if s["kind"] == "mixed"]
    if len(mixed) >= 3:
        x = np.array([[s["decode_s"], s["chunk_s"], 1.0] for s in mixed])
        y = np.array([s["wall"] for s in mixed])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        out["mixed_split"] = {"decode": round(float(coef[0]), 4), "chunk": round(float(coef[1]), 4),
                              "const_ms": round(1000 * float(coef[2]), 3)}
    return out


def _sim_runs(trace: Any, config: Any, cost: Any) -> tuple[Any, list[dict[str, Any]]]:
    """The simulated run and each of its instances' finished step runs (instance, start, end,
    steps, decode rows, chunk tokens per step)."""
    from kvcake.sim.decode import DecodeInstance
    from kvcake.sim.run import simulate

    runs: list[dict[str, Any]] = []
    original = DecodeInstance.on_step_done

    def on_step_done(self: DecodeInstance, now_s: float, token: int) -> Any:
        if token == self.token and self.run is not None:
            run = self.run
            runs.append({"worker": self.index, "t0": run.start_s, "t1": run.end_s,
                         "steps": run.num_steps, "batch": len(self.running),
                         "chunk": self._run_chunk if self._run_prefill is not None else 0})
        return original(self, now_s, token)

    DecodeInstance.on_step_done = on_step_done  # type: ignore[method-assign]
    try:
        result = simulate(config, trace, cost)
    finally:
        DecodeInstance.on_step_done = original  # type: ignore[method-assign]
    return result, runs


def compare_steps(saved: dict[str, Any], trace: Any, config: Any, cost: Any,
                  bucket_s: float = 10.0) -> dict[str, Any]:
    """The live colocated steps of a saved run against the simulator's for the same requests:
    per kind (decode / mixed / chunk) the steps, their mean decode rows, chunk tokens and wall;
    each worker's share of the requests; the batch (both workers) per `bucket_s`."""
    live = [s for s in saved["steps"] if s["t0"] >= 0 and (s["rows"] or s.get("chunks"))]
    result, runs = _sim_runs(trace, config, cost)

    def kind_of(rows: int, chunk: int) -> str:
        return "mixed" if rows and chunk else ("decode" if rows else "chunk")

    out: dict[str, Any] = {"kinds": {}}
    for kind in ("decode", "mixed", "chunk"):
        ls = [s for s in live if kind_of(len(s["rows"]), sum(c[2] for c in s.get("chunks", [])))
              == kind]
        rs = [r for r in runs if kind_of(r["batch"], r["chunk"]) == kind]
        n_sim = sum(r["steps"] for r in rs)
        out["kinds"][kind] = {
            "live_steps": len(ls), "sim_steps": n_sim,
            "live_rows": round(float(np.mean([len(s["rows"]) for s in ls])), 2) if ls else None,
            "sim_rows": round(sum(r["batch"] * r["steps"] for r in rs) / n_sim, 2) if n_sim
            else None,
            "live_chunk": round(float(np.mean([sum(c[2] for c in s.get("chunks", []))
                                               for s in ls])), 1) if ls else None,
            "sim_chunk": round(sum(r["chunk"] * r["steps"] for r in rs) / n_sim, 1) if n_sim
            else None,
            "live_wall_ms": round(1000 * float(np.mean([s["t1"] - s["t0"] for s in ls])), 2)
            if ls else None,
            "sim_wall_ms": round(1000 * sum(r["t1"] - r["t0"] for r in rs) / n_sim, 2) if n_sim
            else None}
    workers = sorted({s["worker"] for s in live})
    first: dict[str, Any] = {}
    for s in sorted(live, key=lambda s: s["t0"]):
        for c in s.get("chunks", []):
            first.setdefault(c[0], s["worker"])
    out["live_requests_per_worker"] = [sum(1 for w in first.values() if w == x) for x in workers]
    out["sim_requests_per_worker"] = [sum(1 for st in result.states
                                          if st.decode_instance == f"colocated-{i}")
                                      for i in range(config.num_prefill + config.num_decode)]
    end = max([s["t1"] for s in live] + [r["t1"] for r in runs])
    series = []
    for b in np.arange(0.0, end, bucket_s):
        ls = [s for s in live if b <= s["t0"] < b + bucket_s]
        sim = [(r["steps"] * ov / (r["t1"] - r["t0"]), r["batch"]) for r in runs
               if r["t1"] > r["t0"] and (ov := min(r["t1"], b + bucket_s) - max(r["t0"], b)) > 0]
        k = sum(x[0] for x in sim)
        series.append({"t_s": float(b),
                       "live_steps": len(ls), "sim_steps": round(k, 1),
                       "live_batch": round(float(np.mean([len(s["rows"]) for s in ls])), 2)
                       if ls else 0.0,
                       "sim_batch": round(sum(a * c for a, c in sim) / k, 2) if k else 0.0})
    out["series"] = series
    return out


def row_bucket(rows: int) -> int:
    """The by-rows table's index of a step with `rows` decode rows (>= 1): 0 .. ROW_BUCKETS-1."""
    if rows < 1:
        raise ValueError(f"a row bucket needs >= 1 decode rows, got {rows}")
    return min(rows, ROW_BUCKETS) - 1


def row_factors(steps: list[dict[str, Any]], pooled: dict[str, float],
                min_steps: int = MIN_BUCKET_STEPS) -> tuple[dict[str, list[float | None]],
                                                            dict[str, list[dict[str, Any]]]]:
    """The `by_rows` table of priced steps (`priced`) and its evidence. Per class and bucket:
    `decode*` = the decode-only steps' wall over their decode price; `chunk_mixed*` = the mixed
    steps' wall less the bucket's decode factor (the table's, else the pooled one) times their
    decode price, over their chunk price. A bucket of fewer than `min_steps` steps: None (the
    pooled factor). Evidence per bucket: steps, factor, its standard error, whether it fell back."""
    if min_steps < 1:
        raise ValueError(f"min_steps must be >= 1, got {min_steps}")
    table: dict[str, list[float | None]] = {}
    evidence: dict[str, list[dict[str, Any]]] = {}
    for cls, busy in (("", False), ("_other_busy", True)):
        of_cls = [s for s in steps if (s["other_busy"] >= OTHER_BUSY) == busy and s["rows"]]
        for name in ("decode", "chunk_mixed"):
            kind = "decode" if name == "decode" else "mixed"
            table[name + cls], evidence[name + cls] = [], []
            for b in range(ROW_BUCKETS):
                group = [s for s in of_cls if s["kind"] == kind
                         and row_bucket(len(s["rows"])) == b]
                f_dec = 0.0 if name == "decode" else (table["decode" + cls][b]
                                                      or pooled["decode" + cls])
                part = "decode_s" if name == "decode" else "chunk_s"
                price = sum(s[part] for s in group)
                factor = ((sum(s["wall"] for s in group) - f_dec * sum(s["decode_s"]
                                                                     for s in group)) / price
                          if price > 0 else None)
                se = None
                if factor is not None:
                    resid = [s["wall"] - f_dec * s["decode_s"] - factor * s[part] for s in group]
                    se = float(np.sqrt(np.sum(np.square(resid)))) / price
                kept = factor is not None and len(group) >= min_steps and factor > 0
                table[name + cls].append(round(float(factor), 4)
                                         if kept and factor is not None else None)
                evidence[name + cls].append({
                    "rows": f"{b + 1}+" if b == ROW_BUCKETS - 1 else str(b + 1),
                    "steps": len(group),
                    "factor": None if factor is None else round(float(factor), 4),
                    "std_err": None if se is None else round(se, 4), "fallback": not kept})
    return table, evidence


def measure(saved: dict[str, Any], decode_fit: Any, prefill_fit: Any,
            by_rows: bool = False, min_steps: int = MIN_BUCKET_STEPS) -> dict[str, Any]:
    """The live profile's `colocated` terms (kvcake/sim/colocated_cost.py) of a saved colocated
    step trace, and the steps' dispersion around them. Per class (the other worker stepping
    through under / over half of the step), each kind of step on its own:
    - `decode*` = the decode-only steps' wall summed over their decode price summed;
    - `chunk_mixed*` = the mixed steps' (decode rows and a chunk in one forward) wall less that
      decode factor times their decode price, over their chunk price;
    - `chunk*` = the chunk-only steps' wall over their chunk price.
    A class without such steps takes the other class's factor (a chunk kind without steps in
    either class: the other chunk kind's). With `by_rows`, also the `by_rows` table
    (`row_factors`). `step_jitter_quantiles`: each step's wall over its priced model (with the
    table when measured), 1st..99th percentile (`host_terms.jittered_tbts`)."""
    steps = priced([s for s in saved["steps"] if s["t0"] >= 0], decode_fit, prefill_fit)
    factors: dict[str, float | None] = {}
    for cls, test in (("", lambda x: x < OTHER_BUSY), ("_other_busy", lambda x: x >= OTHER_BUSY)):
        group = [s for s in steps if test(s["other_busy"])]
        dec = [s for s in group if s["kind"] == "decode"]
        d_price = sum(s["decode_s"] for s in dec)
        factors["decode" + cls] = sum(s["wall"] for s in dec) / d_price if d_price else None
        f = factors["decode" + cls] or 1.0
        for name, kind in (("chunk_mixed", "mixed"), ("chunk", "chunk")):
            of_kind = [s for s in group if s["kind"] == kind]
            c_price = sum(s["chunk_s"] for s in of_kind)
            factors[name + cls] = ((sum(s["wall"] for s in of_kind)
                                    - f * sum(s["decode_s"] for s in of_kind)) / c_price
                                   if c_price else None)
    for a, b in (("decode", "decode_other_busy"), ("chunk", "chunk_other_busy"),
                 ("chunk_mixed", "chunk_mixed_other_busy")):
        factors[a] = factors[a] or factors[b]
        factors[b] = factors[b] or factors[a]
    for a, b in (("chunk", "chunk_mixed"), ("chunk_mixed", "chunk")):
        for cls in ("", "_other_busy"):
            factors[a + cls] = factors[a + cls] or factors[b + cls] or 1.0
    factors["decode"] = factors["decode"] or 1.0
    factors["decode_other_busy"] = factors["decode_other_busy"] or 1.0
    pooled = {k: round(float(v), 4) for k, v in factors.items() if v}
    table, table_evidence = row_factors(steps, pooled, min_steps) if by_rows else ({}, {})
    spread = []
    for s in steps:
        cls = "_other_busy" if s["other_busy"] >= OTHER_BUSY else ""
        chunk = ("chunk_mixed" if s["kind"] == "mixed" else "chunk") + cls
        f_dec, f_chunk = factors["decode" + cls], factors[chunk]
        if table and s["rows"]:
            bucket = row_bucket(len(s["rows"]))
            f_dec = table["decode" + cls][bucket] or f_dec
            if s["kind"] == "mixed":
                f_chunk = table[chunk][bucket] or f_chunk
        model = f_dec * s["decode_s"] + f_chunk * s["chunk_s"]
        if model > 0:
            spread.append(s["wall"] / model)
    oh = overhead_s(steps)
    rows_part: dict[str, Any] = {"by_rows": table} if table else {}
    return {"colocated": {**pooled, "step_overhead_s": round(oh or 0.0, 6), **rows_part},
            "step_jitter_quantiles": (np.percentile(spread, np.arange(1, 100)).round(4).tolist()
                                      if spread else None),
            "evidence": {"steps": len(steps),
                         "by_kind_class": {f"{k}.{c}": sum(
                             1 for s in steps if s["kind"] == k
                             and (s["other_busy"] >= OTHER_BUSY) == (c == "other_busy"))
                             for k in ("decode", "mixed", "chunk")
                             for c in ("other_idle", "other_busy")},
                         **({"by_rows": {"min_steps": min_steps, **table_evidence}}
                            if table else {}),
                         **measure_priced(steps)}}


def print_compare(out: dict[str, Any]) -> None:
    print("| step kind | steps live / sim | decode rows live / sim | chunk tokens live / sim "
          "| wall (ms) live / sim |\n|---|---|---|---|---|")
    for kind, k in out["kinds"].items():
        print(f"| {kind} | {k['live_steps']} / {k['sim_steps']} | {k['live_rows']} / "
              f"{k['sim_rows']} | {k['live_chunk']} / {k['sim_chunk']} | {k['live_wall_ms']} / "
              f"{k['sim_wall_ms']} |")
    print(f"requests per worker live {out['live_requests_per_worker']}, "
          f"sim {out['sim_requests_per_worker']}")
    print("| t (s) | steps live / sim | batch live / sim |\n|---|---|---|")
    for r in out["series"]:
        print(f"| {r['t_s']:.0f} | {r['live_steps']} / {r['sim_steps']} | {r['live_batch']} / "
              f"{r['sim_batch']} |")

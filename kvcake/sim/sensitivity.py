"""`kvcake reproduce sensitivity`: the headline results with each calibrated cost parameter at half
and double its value.

Headline results: MOONCAKE's capacity gain over the best vLLM baseline at TBT 100 / 200 / 300 ms
(the capacity search of `capacity.py`, coarser: to within 10%) and MOONCAKE's mean TBT at
Figure 15's setting (8 prefill + 8 decode, the trace's own rate, TTFT SLO 10 s), for the
profile as calibrated and with one parameter at a time halved or doubled (an efficiency is
capped at 1).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvcake.sim.capacity import SYSTEMS, THRESHOLDS_MS, gains, search_capacity
from kvcake.sim.cluster import cost_model
from kvcake.sim.plots import plot_bars

if TYPE_CHECKING:
    from kvcake.sim.reproduce import Context

PARAMETERS = ("decode_step_overhead_s", "prefill_step_overhead_s", "attention_efficiency",
              "mfu_half_tokens")
FACTORS = (0.5, 2.0)
FIGURE15_TTFT_SLO_S = 10.0


def _variant(ctx: Context, overrides: tuple[tuple[str, float], ...]) -> dict[str, Any]:
    sub = dataclasses.replace(ctx, base=dataclasses.replace(ctx.base,
                                                            hardware_overrides=overrides),
                              runs=0)
    found = search_capacity(sub, rel_tol=0.1, max_probes=7)
    caps = {s: [r.best_speed or 0.0 for r in found[s]] for s in SYSTEMS}
    tbt = sub.sim(policy="global_cache", ttft_slo_s=FIGURE15_TTFT_SLO_S, num_prefill=8,
                  num_decode=8).summary["tbt_s"]["mean"]
    ctx.runs += sub.runs
    return {"gain_vs_best_baseline": gains(caps), "mooncake_capacity": caps["mooncake"],
            "figure15_mean_tbt_ms": 1000 * tbt}


def sensitivity(ctx: Context) -> list[str]:
    hardware = cost_model(ctx.base).hardware
    rows: list[dict[str, Any]] = [{"parameter": "as calibrated", "factor": 1.0, "value": None,
                                   **_variant(ctx, ())}]
    for name in PARAMETERS:
        for factor in FACTORS:
            value = getattr(hardware, name) * factor
            if name.endswith("efficiency"):
                value = min(1.0, value)
            rows.append({"parameter": name, "factor": factor, "value": value,
                         **_variant(ctx, ((name, value),))})
    ctx.data.update({"tbt_slo_ms": list(THRESHOLDS_MS), "rows": rows})
    lines = ctx.header("Sensitivity of the headline results to the calibrated cost parameters")
    lines += [f"Profile `{ctx.base.profile}` as calibrated: " + ", ".join(
        f"{n} = {getattr(hardware, n):g}" for n in PARAMETERS) + ". Capacity searched to within "
        "10% (the capacity report: 5%), so gains here can differ from it by that much.", "",
        "| parameter | value | " + " | ".join(f"gain @ {ms} ms" for ms in THRESHOLDS_MS)
        + " | MOONCAKE capacity @ 100 ms | Figure 15 mean TBT (ms) |",
        "|---" * (len(THRESHOLDS_MS) + 4) + "|"]
    for row in rows:
        value = "-" if row["value"] is None else f"{row['value']:g} (x{row['factor']:g})"
        cells = ["n/a" if g is None else f"{g:+.0%}" for g in row["gain_vs_best_baseline"]]
        lines.append(f"| {row['parameter']} | {value} | " + " | ".join(cells)
                     + f" | {row['mooncake_capacity'][0]:.3g}x | "
                     f"{row['figure15_mean_tbt_ms']:.1f} |")
    lines.append("")
    labels = [r["parameter"].replace("_s", "").replace("_", " ")[:18]
              + ("" if r["value"] is None else f" x{r['factor']:g}") for r in rows]
    plot_bars(ctx.out / f"sensitivity_{ctx.stem}.png", f"Gain at 100 ms, {ctx.stem}", labels,
              {"gain @ 100 ms": [g[0] or 0.0 for g in (r["gain_vs_best_baseline"] for r in rows)]},
              "capacity gain over the best baseline")
    return lines

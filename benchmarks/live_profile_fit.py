"""The live profile `benchmarks/sim_vs_live.py` hands the simulator (`kvcake simulate
--live-profile`): the model's shape, the prefill and decode fits of this machine's engine
(`profile.json`, or refit over the live batches: `--refit-decode`, `--refit-prefill`), the
transfer bandwidth and the live KV pool; and per-host contention factors fitted to one live run
(`--fit-rate` without measured host terms).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from capacity_systems import MAX_MODEL_LEN  # noqa: E402

from kvcake.bench.regime import Regime  # noqa: E402
from kvcake.sim.config import SimConfig  # noqa: E402
from kvcake.sim.live_profile import live_cost_from_dict  # noqa: E402
from kvcake.sim.run import simulate  # noqa: E402
from kvcake.sim.trace import Trace  # noqa: E402

SHAPE_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",  # ours: HF's
              "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
              "intermediate_size": "intermediate_size", "vocab_size": "vocab_size"}


KV_POOL_BYTES = 2**30  # each live worker's pool (capacity_systems.KV_CACHE)


def memcpy_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def transfer_bandwidth(out_dir: Path) -> tuple[float, str]:
    path = out_dir / "transport.json"
    if path.is_file():
        shm = json.loads(path.read_text()).get("transport", {}).get("after_prefill/shm")
        if shm and shm.get("exposed_ms"):
            return shm["mib"] * 2**20 / (shm["exposed_ms"] / 1000.0), "transport.json"
    return memcpy_bandwidth(), "memcpy"


DECODE_REFIT = "decode_refit.json"


def one_thread_engine(model_dir: Path, kv_cache_bytes: int) -> Any:
    """An engine of the current code on one torch thread, as `kvcake profile` measures one."""
    import torch

    from kvcake.engine.config import EngineConfig
    from kvcake.engine.engine import Engine

    torch.set_num_threads(1)
    return Engine(str(model_dir), EngineConfig(kv_cache_bytes=kv_cache_bytes,
                                               max_model_len=MAX_MODEL_LEN))


def refit_decode(out_dir: Path, model_dir: Path) -> dict[str, Any]:
    """Decode steps measured again on one 1-thread engine over the batches and contexts the live
    decode worker runs at (batch 1..24, 512 or 2,048 tokens each; best of 3): `profile.json`'s
    decode points were measured before the profiler timed whole batches (its early requests
    had finished by the timed steps: the points' batches were smaller than labelled, and the
    fit had a ~0 batch term and a negative context term)."""
    from kvcake.conductor import DecodeStepPredictor
    from kvcake.server.cluster.profiler import ProfileGrid, measure_decode

    engine = one_thread_engine(model_dir, KV_POOL_BYTES)
    grid = ProfileGrid(decode_batch_sizes=(1, 4, 8, 16, 24), decode_context_lens=(512, 2048),
                       repeats=3)
    points = measure_decode(engine, grid)
    fit = DecodeStepPredictor.fit(points)
    data = {"decode": json.loads(fit.to_json()),
            "decode_points": [[p.batch_size, p.context_tokens, p.time_s] for p in points]}
    (out_dir / DECODE_REFIT).write_text(json.dumps(data, indent=1) + "\n")
    return data


PREFILL_REFIT = "prefill_refit.json"


def refit_prefill(out_dir: Path, model_dir: Path) -> dict[str, Any]:
    """The prefill regression measured again on one 1-thread engine of the current code, over
    the grid `serving_disagg_vs_colocated.py --measure-regime` used for `profile.json` (256 to
    8,192 tokens, 0 / 50 / 90% cached; best of 2): the regime stays fixed, only the simulator's
    price of a prefill follows the engine (`prefill_refit.json`, used instead of
    `profile.json`'s prefill fit)."""
    from kvcake.conductor import PrefillTimePredictor
    from kvcake.server.cluster.profiler import ProfileGrid, measure_prefill

    engine = one_thread_engine(model_dir, 2 * KV_POOL_BYTES)
    grid = ProfileGrid(input_lens=(256, 1024, 2048, 4096, 8192), prefix_fracs=(0.0, 0.5, 0.9),
                       repeats=2)
    points = measure_prefill(engine, grid)
    fit = PrefillTimePredictor.fit(points)
    data = {"prefill": json.loads(fit.to_json()),
            "prefill_points": [[p.input_len, p.prefix_len, p.time_s] for p in points]}
    (out_dir / PREFILL_REFIT).write_text(json.dumps(data, indent=1) + "\n")
    return data


def refit(into: Path, model_dir: Path, decode: bool, prefill: bool) -> None:
    """`sim_vs_live.py --refit-decode / --refit-prefill`: the chosen fits measured again, written
    into `into` (--refit-into, default --out-dir) and printed."""
    into.mkdir(parents=True, exist_ok=True)
    for wanted, measure in ((decode, refit_decode), (prefill, refit_prefill)):
        if wanted:
            print(json.dumps(measure(into, model_dir)))


def live_profile(out_dir: Path, model_config: dict[str, Any], bandwidth: float,
                 dtype_bytes: int = 4, contention: dict[str, float] | None = None,
                 refits_dir: Path | None = None) -> dict[str, Any]:
    """`profile.json` + the `live` object kvcake/sim/live_profile.py reads; the decode and
    prefill models from `decode_refit.json` / `prefill_refit.json` where --refit-decode /
    --refit-prefill wrote them (in `refits_dir`, default `out_dir`; a refit in `out_dir` must
    have its counterpart there: the two ends of a bracket are measured alike)."""
    data: dict[str, Any] = json.loads((out_dir / "profile.json").read_text())
    for refit in (DECODE_REFIT, PREFILL_REFIT):
        path = (refits_dir or out_dir) / refit
        if refits_dir is not None and (out_dir / refit).is_file() and not path.is_file():
            raise SystemExit(f"{path} not found: {out_dir / refit} prices the run's start, so "
                             f"its end needs one too (--refit-into {refits_dir})")
        if path.is_file():
            data.update(json.loads(path.read_text()))
    shape = {k: int(model_config[hf]) for k, hf in SHAPE_KEYS.items()}
    kv_per_token = (2 * shape["num_layers"] * shape["num_kv_heads"]
                    * (shape["hidden_size"] // shape["num_heads"]) * dtype_bytes)
    data["live"] = {"transfer_bandwidth_bytes_per_s": bandwidth,
                    "kv_pool_tokens": KV_POOL_BYTES // kv_per_token, "shape": shape,
                    "dtype_bytes": dtype_bytes,
                    "topology": {"num_prefill": 1, "num_decode": 1}}
    if contention is not None:
        data["live"]["contention"] = contention
    return data


def fit_factor(target: float, measure: Any, lo: float = 0.5, hi: float = 8.0,
               steps: int = 14) -> float:
    """The factor f in [lo, hi] with measure(f) ~ target, by bisection on a log scale
    (measure grows with f; the bounds when the target lies outside)."""
    if measure(lo) >= target:
        return lo
    if measure(hi) <= target:
        return hi
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if measure(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def fit_contention(profile: dict[str, Any], live: dict[str, float], trace: Trace,
                   regime: Regime, config: SimConfig) -> dict[str, float]:
    """Per-host factors from one live disaggregated run: prefill so the simulated TTFT p50
    matches the live one, decode so the TBT p50 does (each other factor held; twice round)."""
    factors = {"decode": 1.0, "prefill": 1.0}

    def metric(name: str, key: str) -> Any:
        def measure(f: float) -> float:
            data = dict(profile, live={**profile["live"], "contention": {**factors, name: f}})
            cost = live_cost_from_dict(data).as_cost_model()
            return 1000 * simulate(config, trace, cost).summary[key]["p50"]
        return measure

    for _ in range(2):
        factors["prefill"] = fit_factor(live["ttft_p50_ms"], metric("prefill", "ttft_s"))
        factors["decode"] = fit_factor(live["tbt_p50_ms"], metric("decode", "tbt_s"))
    return {k: round(v, 4) for k, v in factors.items()}

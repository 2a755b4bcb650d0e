"""The regime of `benchmarks/serving_disagg_vs_colocated.py`, measured once before any system
runs (`--measure-regime`: the profile of one 1-thread engine of the benchmark model, then the
pure derivation of kvcake/bench/regime.py; the derivation is that script's docstring), read
back by every step (`load_regime`); the trace records it is derived from; the model directory
and the vLLM peer every system uses (`prepare_model`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_servers as servers  # noqa: E402
from capacity_systems import MAX_MODEL_LEN  # noqa: E402

from kvcake.bench.regime import Regime, Replay, derive_regime  # noqa: E402
from kvcake.engine.config import EngineConfig  # noqa: E402
from kvcake.sim.trace import TraceRequest, load_trace  # noqa: E402


def records_of(trace: Path, num_requests: int) -> list[TraceRequest]:
    return list(load_trace(trace).sampled(first=num_requests).requests)


def measure_regime(args: argparse.Namespace) -> Regime:
    """See the module docstring: measured on one 1-thread engine, then derived (pure)."""
    import torch

    from kvcake.server.cluster.profiler import ProfileGrid, run_profile

    model_config = prepare_model(args)
    torch.set_num_threads(1)
    grid = ProfileGrid(input_lens=(256, 1024, 2048, 4096, 8192), prefix_fracs=(0.0, 0.5, 0.9),
                       decode_batch_sizes=(1, 8, 16), decode_context_lens=(256, 2048),
                       repeats=2)
    engine = EngineConfig(kv_cache_bytes=2 * 2**30, max_model_len=MAX_MODEL_LEN)
    started = time.perf_counter()
    profile = run_profile(str(args.model_dir), engine, grid)
    print(f"[regime] profiled in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    (args.out_dir / "profile.json").write_text(profile.to_json())
    records = records_of(args.trace, args.num_requests)
    regime = derive_regime(
        profile.decode.decode_step_time_s, lambda n: profile.prefill.predict(n, 0),
        Replay(float(np.mean([r.input_len for r in records])),
               [r.output_len for r in records], num_requests=args.num_requests,
               max_probes=args.max_probes),
        max_model_len=MAX_MODEL_LEN)
    del model_config
    return regime


def prepare_model(args: argparse.Namespace) -> Any:
    ensure_peer(args)
    return servers.prepare_model(args.tokenizer_dir, args.model_dir, args.seed)


def ensure_peer(args: argparse.Namespace) -> None:
    """The vLLM CPU venv and the model's config/tokenizer: set up by the peer script if absent."""
    venv = Path(os.environ.get("VENV", "/tmp/vllmcpu-venv"))
    have_vllm = (venv / "bin" / "python").is_file() and subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import vllm"], capture_output=True).returncode == 0
    if have_vllm and (args.tokenizer_dir / "tokenizer.json").is_file():
        return
    print(f"[peer] setting up the vLLM CPU peer ({servers.PEERS / 'vllm_cpu_setup.sh'})",
          file=sys.stderr, flush=True)
    subprocess.run(["bash", str(servers.PEERS / "vllm_cpu_setup.sh")], check=True,
                   env={**os.environ, "VENV": str(venv), "MODEL_DIR": str(args.tokenizer_dir)},
                   stdout=sys.stderr)


def load_regime(args: argparse.Namespace) -> Regime:
    path = args.out_dir / "regime.json"
    if not path.is_file():
        raise SystemExit(f"{path} not found: run --measure-regime first (the regime is fixed "
                         "before any system runs)")
    return Regime.from_json(path.read_text())

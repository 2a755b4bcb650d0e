r"""The decode step at batch 1-8 by component against its memory floor, with the one-row (and
few-row) GEMM backends A/B'd inside the engine: the start-up choice against each backend forced.

    .venv/bin/python benchmarks/decode_ab.py [--model DIR] [--context 2048] [--batches 1,4,8]
        [--threads 2] [--blocks 10] [--block-steps 16] [--json OUT]

Offline, no server. The default model is the shape `benchmarks/serving_vs_vllm.py` serves (Llama,
hidden 512, 4 layers, vocab 32,000; seeded random weights, fp32), written to a temporary Hugging
Face directory. Printed, in order:

1. the memory read bandwidth of this machine with 1 and with `--threads` threads (a 256 MiB
   fp32 sum, best of 5), which makes each component's floor: its bytes / the bandwidth;
2. the start-up tuner's measurement per weight shape (ms per backend, one row and four rows;
   caches flushed, the minimum of its rounds) and its choice;
3. per batch size: `--batches` sequences of `--context` (seeded) prompt tokens are prefilled,
   then the decode step runs in blocks of `--block-steps` steps, one block per mode in turn
   (the order reversed every other block, so a mode never always follows the same one, and
   the context grows alike for all), `--blocks` rounds: `tuned` (the start-up choices) and
   every backend forced for that batch's row bucket wherever it applies. Per mode: the step's
   wall ms p10 / p50 / p90 and CPU ms p50 (this process);
4. per batch size, one more such round with every component timed, per mode: each linear
   kind, the decode attention op, the rest of the model's forward (norms, RoPE, embedding, the
   layer loop), and the rest of the step outside the model (scheduling, the runner's tensors,
   sampling, outputs), p50 ms per step, with each one's floor.

A mode's steps differ only in the GEMM backend of the bucket under test; the machine is shared,
so read p10/p50 of several blocks, and take the bench lock (`flock /tmp/kvcake_bench.lock ...`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvcake.engine import model as model_mod
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.linear import (
    BACKENDS,
    BUCKET_NAMES,
    BUCKETS,
    COLD_ROWS,
    Kernel,
    Linear,
    _eligible,
    bucket_of,
)
from kvcake.engine.loader import dummy_weights, save_hf_dir
from kvcake.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from step_profile import PEER_SHAPE  # noqa: E402


def bandwidth_gbs(threads: int) -> float:
    """Best-of-5 read rate of a 256 MiB fp32 tensor summed on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        big = torch.ones(64 << 20)
        big.sum()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            big.sum()
            best = min(best, time.perf_counter() - t0)
        return big.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]  # layers.0.qkv_proj -> qkv_proj; lm_head


def _kernels(engine: Engine) -> dict[str, list[Kernel]]:
    kinds: dict[str, list[Kernel]] = defaultdict(list)
    for name, mod in engine.model.named_modules():
        if isinstance(mod, Linear) and mod.kernel is not None:
            kinds[_kind(name)].append(mod.kernel)
    return kinds


def _set_mode(kernels: list[Kernel], tuned: dict[int, list[str]], bucket: int, mode: str) -> None:
    for k in kernels:
        backend = tuned[id(k)][bucket] if mode == "tuned" else \
            (mode if _eligible(mode, bucket) else tuned[id(k)][bucket])
        k.prepare(backend)
        k.choice[bucket] = backend
        k.bind()


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def _ab(engine: Engine, kernels: list[Kernel], tuned: dict[int, list[str]], bucket: int,
        modes: list[str], blocks: int, block_steps: int) -> dict[str, dict[str, float]]:
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for blk in range(blocks):
        for mode in (modes if blk % 2 == 0 else modes[::-1]):
            _set_mode(kernels, tuned, bucket, mode)
            engine.step()  # the first step after a switch: page faults of a new packed form
            for _ in range(block_steps):
                c0, t0 = time.process_time(), time.perf_counter()
                engine.step()
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
    _set_mode(kernels, tuned, bucket, "tuned")
    return {m: {"wall_p10_ms": 1e3 * _pct(wall[m], 0.1),
                "wall_p50_ms": 1e3 * statistics.median(wall[m]),
                "wall_p90_ms": 1e3 * _pct(wall[m], 0.9),
                "cpu_p50_ms": 1e3 * statistics.median(cpu[m]), "steps": len(wall[m])}
            for m in modes}


def _components(engine: Engine, kinds: dict[str, list[Kernel]], tuned: dict[int, list[str]],
                bucket: int, modes: list[str], blocks: int,
                block_steps: int) -> dict[str, dict[str, float]]:
    """Per mode, p50 ms per step of each component, timed by wrappers (modes alternating in
    blocks, as in `_ab`)."""
    kernels = [k for ks in kinds.values() for k in ks]
    per: dict[str, dict[str, list[float]]] = {m: defaultdict(list) for m in modes}
    for blk in range(blocks):
        for mode in (modes if blk % 2 == 0 else modes[::-1]):
            _set_mode(kernels, tuned, bucket, mode)
            engine.step()
            _timed_steps(engine, kinds, bucket, block_steps, per[mode])
    _set_mode(kernels, tuned, bucket, "tuned")
    result = {}
    for mode in modes:
        out = {name: 1e3 * statistics.median(v) for name, v in per[mode].items()}
        linears = sum(out.get(kind, 0.0) for kind in kinds)
        out["model_other"] = out["forward"] - linears - out.get("attention", 0.0)
        out["outside_model"] = out["step"] - out["forward"]
        result[mode] = out
    return result


def _timed_steps(engine: Engine, kinds: dict[str, list[Kernel]], bucket: int, steps: int,
                 per: dict[str, list[float]]) -> None:
    acc: dict[str, float] = defaultdict(float)

    def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            acc[name] += time.perf_counter() - t0
            return out
        return run

    for kind, kernels in kinds.items():
        for k in kernels:
            assert k._fns is not None
            k._fns[bucket] = timed(k._fns[bucket], kind)
    attention = model_mod.paged_decode_attention
    model_mod.paged_decode_attention = timed(attention, "attention")  # type: ignore[assignment]
    forward = engine.model.forward
    engine.model.forward = timed(forward, "forward")  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            acc.clear()
            t0 = time.perf_counter()
            engine.step()
            acc["step"] = time.perf_counter() - t0
            for name, value in acc.items():
                per[name].append(value)
    finally:
        model_mod.paged_decode_attention = attention  # type: ignore[assignment]
        del engine.model.forward
        for kernels in kinds.values():
            for k in kernels:
                k.bind()


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    bw1, bw = bandwidth_gbs(1), bandwidth_gbs(args.threads)
    print(f"read bandwidth: {bw1:.1f} GB/s on 1 thread, {bw:.1f} GB/s on {args.threads}")
    batches = sorted(int(b) for b in args.batches.split(","))
    engine = Engine(model, EngineConfig(dtype="float32", device="cpu", kv_cache_bytes=1 << 30,
                                        max_num_batched_tokens=args.context + 16))
    print(f"start-up choices (rows {BUCKET_NAMES}), the tuner's ms in the few-row buckets:")
    tuner: dict[str, Any] = {}
    for c in engine.linear_choices:
        key = f"{c.shape[0]}x{c.shape[1]}"
        tuner[key] = {"choice": list(c.backends), "ms": list(c.ms)}
        print(f"  {key}: {'|'.join(c.backends)}")
        for (_, rows), ms in zip(BUCKETS, c.ms, strict=True):
            if rows <= COLD_ROWS:
                line = ", ".join(f"{b} {t:.3f}" for b, t in ms.items()) or "(from the table)"
                print(f"    {rows} rows: {line}")
    kinds = _kernels(engine)
    kernels = [k for ks in kinds.values() for k in ks]
    tuned = {id(k): list(k.choice) for k in kernels}
    weight_bytes = {kind: sum(k.weight.numel() * 4 for k in ks) for kind, ks in kinds.items()}
    cfg = engine.model.config
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * 4
    results: dict[str, Any] = {"bandwidth_gbs": {"1": bw1, str(args.threads): bw},
                               "tuner": tuner, "batches": {}}
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            prompt = [int(x) for x in torch.randint(4, cfg.vocab_size, (args.context,),
                                                    generator=gen)]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=8192, ignore_eos=True))
        for _ in range(batch + 3):  # every prompt prefilled (one a step), then decode steps
            engine.step()
        bucket = bucket_of(batch)
        modes = ["tuned"] + [b for b in BACKENDS if _eligible(b, bucket)]
        ab = _ab(engine, kernels, tuned, bucket, modes, args.blocks, args.block_steps)
        comp = _components(engine, kinds, tuned, bucket, modes, args.blocks, args.block_steps)
        ctx = args.context + 3 + 2 * len(modes) * (args.block_steps + 1) * args.blocks
        floors = {kind: b / bw / 1e6 for kind, b in weight_bytes.items()}
        floors["attention"] = batch * ctx * kv_bytes_per_token / bw / 1e6
        floors["step"] = sum(floors.values())
        print(f"\nbatch {batch} (row bucket {bucket}), context ~{args.context}-{ctx}:")
        for mode, r in ab.items():
            print(f"  {mode:>9}: wall p10 {r['wall_p10_ms']:6.2f}  p50 {r['wall_p50_ms']:6.2f}  "
                  f"p90 {r['wall_p90_ms']:6.2f} ms, CPU p50 {r['cpu_p50_ms']:6.2f} ms "
                  f"({r['steps']} steps)")
        print("  components, p50 ms per step (floor: bytes read / the measured bandwidth):")
        print(f"    {'':>14}  {'floor':>6}" + "".join(f"  {m:>9}" for m in modes))
        for name in [*kinds, "attention", "model_other", "outside_model", "step"]:
            floor = f"{floors[name]:6.2f}" if name in floors else f"{'':6}"
            print(f"    {name:>14}  {floor}" + "".join(f"  {comp[m].get(name, 0.0):9.2f}"
                                                   for m in modes))
        share = comp["tuned"]["outside_model"] / comp["tuned"]["step"]
        print(f"  outside the model (tuned): {100 * share:.1f}% of the step")
        results["batches"][str(batch)] = {"ab": ab, "components": comp, "floors": floors}
        for rid in ids:
            engine.abort(rid)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or preset (default: the "
                   "serving_vs_vllm.py shape, seeded random weights)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--block-steps", type=int, default=16)
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.context < 1 or args.blocks < 1 or args.block_steps < 1:
        p.error("--context, --blocks and --block-steps must be >= 1")
    if args.model is None:
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_dir(PEER_SHAPE, dummy_weights(PEER_SHAPE, 0), Path(tmp))
            results = run(args, tmp)
    else:
        results = run(args, args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

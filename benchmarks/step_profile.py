r"""Profile of one engine's prefill and decode steps (torch.profiler), offline, no server.

    .venv/bin/python benchmarks/step_profile.py                 # the vLLM-comparison model shape
    .venv/bin/python benchmarks/step_profile.py --prompt-len 2048 --decode-steps 32 --seqs 1 \
        --threads 2 [--model DIR_OR_PRESET] [--json OUT]
    .venv/bin/python benchmarks/step_profile.py --prefix-len 2048 --prompt-len 300 --rounds 5
        # the agent trace's shape: a cached 2,048-token prefix + 300 new tokens a prefill

The default model is the shape `benchmarks/serving_vs_vllm.py` serves (Llama, hidden 512, 4
layers, 8 heads / 2 KV heads, intermediate 1408, vocab 32000; seeded random weights, fp32),
written to a temporary Hugging Face directory. It runs: a warm-up request, then `--seqs` fresh
prompts of `--prompt-len` tokens prefilled (one step each; after a shared `--prefix-len`-token
prefix that the warm-up put in the prefix cache, so only the new tokens are computed), then
`--decode-steps` decode
steps of all of them together; `--rounds` such rounds unprofiled (the wall times: median and best
over rounds), then one profiled. Printed per phase: wall ms per step without the
profiler, the top ops by self CPU time, and the share of the profiled step spent outside torch
ops (Python, the runner's tensor building, sampling bookkeeping): what the issue calls the
Python overhead of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvcake.engine.config import EngineConfig, ModelConfig
from kvcake.engine.engine import Engine
from kvcake.engine.loader import dummy_weights, save_hf_dir

try:
    from kvcake.engine.linear import BUCKET_NAMES
except ImportError:  # an older checkout (PYTHONPATH) without tuned linears
    BUCKET_NAMES = "-"
from kvcake.engine.sampling import SamplingParams

PEER_SHAPE = ModelConfig(name="peer-tiny-llama", vocab_size=32000, hidden_size=512,
                         intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2,
                         max_position_embeddings=32768)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(4, vocab, (n,), generator=gen)]


def _outside_ops_share(prof: Any, step_name: str) -> tuple[float, float]:
    """(mean profiled ms of a `step_name` range, share of it not inside any top-level op)."""
    events = list(prof.events())
    steps = [e for e in events if e.name == step_name]
    if not steps:
        return 0.0, 0.0
    total = sum(e.time_range.elapsed_us() for e in steps)
    inside = 0.0
    for e in events:
        parent = e.cpu_parent
        if parent is not None and parent.name == step_name and e.device_type.name == "CPU":
            inside += e.time_range.elapsed_us()
    return total / len(steps) / 1e3, max(0.0, 1.0 - inside / total)


def _top_ops(prof: Any, count: int) -> list[dict[str, Any]]:
    rows = [e for e in prof.key_averages() if not e.key.startswith(("prefill_step",
                                                                     "decode_step"))]
    total = sum(e.self_cpu_time_total for e in rows) or 1.0
    rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in rows[:count]]


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    engine = Engine(model, EngineConfig(dtype="float32", device="cpu",
                                        max_num_batched_tokens=max(2048, args.prompt_len)))
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.decode_steps + 1, ignore_eos=True)
    prefix = _prompt(args.prefix_len, 998, vocab)
    engine.add_request("warm", prefix + _prompt(args.prompt_len, 999, vocab),
                       SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    result: dict[str, Any] = {"threads": args.threads, "prompt_len": args.prompt_len,
                              "prefix_len": args.prefix_len,
                              "seqs": args.seqs, "load_avg": os.getloadavg()[0],
                              # getattr: the script also profiles older checkouts (PYTHONPATH)
                              "attention": getattr(engine, "attention", "gather"),
                              "linear": {f"{c.shape[0]}x{c.shape[1]}": list(c.backends)
                                         for c in getattr(engine, "linear_choices", [])}}
    walls: dict[str, list[float]] = {"prefill": [], "decode": []}
    for rnd, profiled in enumerate([False] * args.rounds + [True]):
        for i in range(args.seqs):
            engine.add_request(f"r{rnd}-{i}",
                               prefix + _prompt(args.prompt_len, 10 * rnd + i, vocab), params)
        with profile(activities=[ProfilerActivity.CPU]) if profiled else _Null() as prof:
            prefill_s = []
            for _ in range(args.seqs):
                t0 = time.perf_counter()
                with record_function("prefill_step"):
                    engine.step()
                prefill_s.append(time.perf_counter() - t0)
            decode_s = []
            while engine.has_unfinished():
                t0 = time.perf_counter()
                with record_function("decode_step"):
                    engine.step()
                decode_s.append(time.perf_counter() - t0)
        if not profiled:  # the unprofiled rounds give the wall times
            walls["prefill"] += prefill_s
            walls["decode"].append(sum(decode_s) / len(decode_s))
            continue
        for phase, times in walls.items():  # median and best round (a busy machine's noise)
            result[f"{phase}_wall_ms"] = 1e3 * statistics.median(times)
            result[f"{phase}_wall_min_ms"] = 1e3 * min(times)
        for phase in ("prefill", "decode"):
            ms, share = _outside_ops_share(prof, f"{phase}_step")
            result[f"{phase}_profiled_ms"] = ms
            result[f"{phase}_outside_ops_share"] = share
        result["top_ops"] = _top_ops(prof, args.top)
        # The prefill and decode ops separately: a second pass over each phase's events.
        result["top_ops_by_phase"] = _by_phase(prof, args.top)
    return result


def _by_phase(prof: Any, count: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    events = list(prof.events())
    for phase in ("prefill_step", "decode_step"):
        tops = [e for e in events if e.name == phase]
        per_op: dict[str, float] = {}
        total = sum(e.time_range.elapsed_us() for e in tops) or 1.0
        stack = list(tops)
        while stack:
            e = stack.pop()
            for c in e.cpu_children:
                per_op[c.name] = per_op.get(c.name, 0.0) + c.self_cpu_time_total
                stack.append(c)
        ranked = sorted(per_op.items(), key=lambda kv: kv[1], reverse=True)[:count]
        out[phase] = [{"op": k, "ms_per_step": v / 1e3 / len(tops), "share": v / total}
                      for k, v in ranked]
    return out


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="preset or HF directory (default: the peer shape, "
                                   "seeded random weights)")
    p.add_argument("--prompt-len", type=int, default=2048,
                   help="new (uncached) tokens of each profiled prompt")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="a shared prefix before them, cached by the warm-up (0: cold prompts; "
                        "with a prefix, --seqs 1 keeps one prefill a step)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1,
                   help="unprofiled rounds (fresh prompts each); wall times: median and best")
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    for name in ("prompt_len", "decode_steps", "seqs", "threads", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prefix_len < 0 or args.prefix_len % 16:
        p.error("--prefix-len must be >= 0 and a multiple of 16 (whole KV blocks are cached)")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            save_hf_dir(PEER_SHAPE, dummy_weights(PEER_SHAPE, 0), Path(tmp))
            model = tmp
        result = run(args, model)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load avg "
          f"{result['load_avg']:.2f}, {args.threads} threads, {args.seqs} x {args.prompt_len}-token "
          f"prompt(s) after a cached {args.prefix_len}-token prefix, {args.decode_steps} decode "
          f"steps")
    print(f"attention: {result['attention']}; linear backend per shape (out x in) for rows "
          f"{BUCKET_NAMES}: {json.dumps(result['linear'])}")
    for phase in ("prefill", "decode"):
        print(f"\n{phase}: {result[f'{phase}_wall_ms']:.2f} ms/step wall (unprofiled; median "
              f"of {args.rounds} round(s), best {result[f'{phase}_wall_min_ms']:.2f}), "
              f"{result[f'{phase}_profiled_ms']:.2f} ms profiled, "
              f"{100 * result[f'{phase}_outside_ops_share']:.1f}% outside torch ops")
        print("| op | ms/step | share |\n|---|---|---|")
        for row in result["top_ops_by_phase"][f"{phase}_step"]:
            print(f"| {row['op']} | {row['ms_per_step']:.3f} | {100 * row['share']:.1f}% |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

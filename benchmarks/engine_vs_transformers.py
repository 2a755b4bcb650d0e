"""kvcake's engine vs Hugging Face transformers on the same weights and prompts, in one run.

    .venv/bin/python benchmarks/engine_vs_transformers.py            # the `small` preset (~100M)
    .venv/bin/python benchmarks/engine_vs_transformers.py --quick    # tiny shapes, a smoke run

Three measurements (issue 2), each printed with its ratio:
1. prefill tokens/s of one prompt: our engine (one step, no prefix cache) vs one transformers
   forward that computes only the last position's logits (target >= 1.0x);
2. 16 concurrent greedy generations of 128 tokens each (prompts of different lengths): our
   continuous batching vs transformers `generate`, the better of one-by-one and a left-padded
   batch (target >= 2x tokens/s);
3. TTFT of a 4,096-token prompt whose first 3,840 tokens are in our prefix cache vs the same
   prompt cold on our engine (target <= 0.15x).
The preset's seeded dummy weights are written once as a Hugging Face directory; both systems
load that directory. Each timing is the median of --reps runs after a warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvcake.engine.config import PRESETS, EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.loader import dummy_weights, save_hf_dir
from kvcake.engine.sampling import SamplingParams


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _medians_s(fns: dict[str, Callable[[], object]], reps: int, device: str,
               warmups: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    """Median wall time of each fn. Runs are interleaved (ours, theirs, ours, ...) so that a
    change in background load on a shared machine hits both sides alike."""
    for name, fn in fns.items():
        (warmups or {}).get(name, fn)()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(3, vocab, (n,), generator=gen)]


def _run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                tag: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


class _Tag:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"run{self.n}"


def bench_prefill(engine: Engine, hf: Any, n: int, reps: int, dev: str) -> dict:
    prompt = _prompt(n, 1, engine.model_config.vocab_size)
    ids = torch.tensor([prompt], device=dev)
    tag = _Tag()
    with torch.inference_mode():
        t = _medians_s({
            "ours": lambda: _run_engine(engine, [prompt], SamplingParams(max_tokens=1), tag()),
            "hf": lambda: hf(ids, logits_to_keep=1)}, reps, dev)
    ours, theirs = t["ours"], t["hf"]
    return {"prompt_len": n, "ours_tok_s": n / ours, "hf_tok_s": n / theirs,
            "ratio": theirs / ours}


def bench_decode(engine: Engine, hf: Any, num_seqs: int, gen_len: int,
                 reps: int, dev: str) -> dict:
    vocab = engine.model_config.vocab_size
    lens = [32 + (i * 37) % 129 for i in range(num_seqs)]  # 32..160 tokens
    prompts = [_prompt(n, 100 + i, vocab) for i, n in enumerate(lens)]
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    tag = _Tag()
    ours_out: dict[str, list[int]] = {}

    def ours_run() -> None:
        ours_out.clear()
        ours_out.update(_run_engine(engine, prompts, params, tag()))

    short = SamplingParams(max_tokens=4, ignore_eos=True)
    gen_kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    hf_single: list[list[int]] = []

    def one_by_one() -> None:
        hf_single.clear()
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=dev), **gen_kw)
            hf_single.append(out[0, len(p):].tolist())

    width = max(lens)
    padded = torch.zeros(num_seqs, width, dtype=torch.long, device=dev)
    mask = torch.zeros(num_seqs, width, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generate expects
        padded[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    warm_kw = {**gen_kw, "max_new_tokens": 4, "min_new_tokens": 4}
    with torch.inference_mode():
        t = _medians_s(
            {"ours": ours_run, "hf_batch": lambda: hf.generate(padded, attention_mask=mask,
                                                               **gen_kw),
             "hf_one": one_by_one},
            reps, dev, warmups={
                "ours": lambda: _run_engine(engine, prompts, short, tag()),
                "hf_batch": lambda: hf.generate(padded, attention_mask=mask, **warm_kw),
                "hf_one": lambda: hf.generate(torch.tensor([prompts[0]], device=dev),
                                              **warm_kw)})
    ours, hf_one, hf_batch = t["ours"], t["hf_one"], t["hf_batch"]
    ours_tokens = [ours_out[k] for k in sorted(ours_out, key=lambda k: int(k.rsplit("-", 1)[1]))]
    same = sum(a == b for a, b in zip(ours_tokens, hf_single, strict=True))
    total = num_seqs * gen_len
    best = min(hf_one, hf_batch)
    return {"num_seqs": num_seqs, "gen_len": gen_len, "ours_tok_s": total / ours,
            "hf_one_by_one_tok_s": total / hf_one, "hf_padded_batch_tok_s": total / hf_batch,
            "ratio_vs_best_hf": best / ours, "greedy_sequences_equal_hf": f"{same}/{num_seqs}"}


def bench_cached_ttft(engine: Engine, cold: Engine, n: int, cached: int, reps: int,
                      dev: str) -> dict:
    vocab = engine.model_config.vocab_size
    prefix = _prompt(cached, 7, vocab)
    one = SamplingParams(max_tokens=1)
    tag = _Tag()
    hot_s: list[float] = []
    cold_s: list[float] = []
    hits: set[int] = set()
    for _ in range(reps):
        suffix = _prompt(n - cached, 1000 + tag.n, vocab)  # a fresh suffix every run
        _run_engine(engine, [prefix], one, tag())  # make sure the prefix is cached
        hot_s.append(_ttft(engine, prefix + suffix, tag(), dev, hits))
        cold_s.append(_ttft(cold, prefix + suffix, tag(), dev, set()))
    hot, cold_t = statistics.median(hot_s), statistics.median(cold_s)
    return {"prompt_len": n, "cached_len": sorted(hits), "ours_cached_ttft_s": hot,
            "ours_cold_ttft_s": cold_t, "ratio": hot / cold_t}


def _ttft(engine: Engine, prompt: list[int], rid: str, dev: str, hits: set[int]) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1))
    while True:
        outs = engine.step()
        if outs:
            _sync(dev)
            hits.add(outs[0].num_cached_tokens)
            return time.perf_counter() - t0


def bench_step_breakdown(engine: Engine, hf: Any, num_seqs: int, reps: int) -> dict:
    """Where one decode step's time goes at batch `num_seqs` (CPU): the bare weight matmuls of
    one step (every projection and the lm_head on `num_seqs` rows, in F.linear's x @ W^T and
    in the W @ x^T orientation) vs one step of ours (linear backends as tuned at start-up, and
    all forced to torch's F.linear) vs one `generate`-style decode forward of transformers on a
    left-padded batch with a KV cache. Each timing interleaved, median."""
    from kvcake.engine.linear import Linear, tune

    vocab = engine.model_config.vocab_size
    lens = [32 + (i * 37) % 129 for i in range(num_seqs)]
    prompts = [_prompt(n, 100 + i, vocab) for i, n in enumerate(lens)]
    for i, p in enumerate(prompts):
        engine.add_request(f"bd-{i}", p, SamplingParams(max_tokens=4 * reps + 8, ignore_eos=True))
    engine.step()  # prefill all
    weights = [m.weight for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(num_seqs, w.shape[1], dtype=w.dtype) for w in weights}
    width = max(lens)
    padded = torch.zeros(num_seqs, width, dtype=torch.long)
    mask = torch.zeros(num_seqs, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = hf(padded, attention_mask=mask, use_cache=True)
    hf_state = {"pkv": out.past_key_values, "mask": mask,
                "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def hf_step() -> None:
        hf_state["mask"] = torch.cat([hf_state["mask"], torch.ones(num_seqs, 1, dtype=torch.long)],
                                     dim=1)
        o = hf(hf_state["next"], attention_mask=hf_state["mask"], past_key_values=hf_state["pkv"],
               use_cache=True, logits_to_keep=1)
        hf_state["pkv"] = o.past_key_values
        hf_state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)

    layers = [m for m in engine.model.modules() if isinstance(m, Linear)]
    tuned = [m.kernel for m in layers]
    tune(layers, "aten")
    plain = [m.kernel for m in layers]

    def ours_step(kernels: list[Any]) -> Callable[[], object]:
        def run() -> None:
            for m, k in zip(layers, kernels, strict=True):
                m.kernel = k
            engine.step()
        return run

    fns: dict[str, Callable[[], object]] = {
        "matmuls_x_Wt": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
        "matmuls_W_xt": lambda: [torch.mm(w, xs[w.shape[1]].t()) for w in weights],
        "ours_step": ours_step(tuned),
        "ours_step_x_Wt": ours_step(plain),
        "hf_step": hf_step,
    }
    try:
        with torch.inference_mode():
            t = _medians_s(fns, reps, "cpu")
    finally:
        for m, k in zip(layers, tuned, strict=True):
            m.kernel = k
        for i in range(num_seqs):
            engine.abort(f"bd-{i}")
    return {"batch": num_seqs, **{f"{k}_ms": round(v * 1e3, 1) for k, v in t.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset whose dummy weights both load")
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--ttft-len", type=int, default=4096)
    ap.add_argument("--cached-len", type=int, default=3840)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-reps", type=int, default=1,
                    help="timed runs of the generation benchmark (after a short warm-up)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (smoke run)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the decode-step breakdown (matmuls vs our step vs transformers')")
    args = ap.parse_args()
    if args.quick:
        args.model, args.prefill_len, args.num_seqs, args.gen_len = "tiny", 256, 4, 16
        args.ttft_len, args.cached_len, args.reps = 512, 448, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import transformers

    config = PRESETS[args.model]
    dtype = getattr(torch, args.dtype)
    engine_cfg = EngineConfig(kv_cache_bytes=1024 * 2**20, dtype=args.dtype, device=args.device,
                              max_num_batched_tokens=2048)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_dir(config, dummy_weights(config, seed=0), Path(tmp))
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp, torch_dtype=dtype)
        hf = hf.to(args.device).eval()
        cold = Engine(tmp, dataclasses.replace(engine_cfg, enable_prefix_caching=False))
        warm = Engine(tmp, engine_cfg)
    print(f"model={args.model} ({config.num_params() / 1e6:.0f}M params) dtype={args.dtype} "
          f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"transformers={transformers.__version__}", flush=True)
    if args.breakdown:
        print(json.dumps({"step_breakdown": bench_step_breakdown(
            cold, hf, args.num_seqs, max(args.reps, 5))}), flush=True)
        return
    results = {"prefill": bench_prefill(cold, hf, args.prefill_len, args.reps, args.device)}
    print(json.dumps({"prefill": results["prefill"]}), flush=True)
    results["decode"] = bench_decode(cold, hf, args.num_seqs, args.gen_len, args.decode_reps,
                                     args.device)
    print(json.dumps({"decode": results["decode"]}), flush=True)
    results["cached_ttft"] = bench_cached_ttft(warm, cold, args.ttft_len, args.cached_len,
                                               args.reps, args.device)
    print(json.dumps({"cached_ttft": results["cached_ttft"]}), flush=True)
    print(f"prefill   ours/hf tokens/s = {results['prefill']['ratio']:.2f}x (target >= 1.0x)")
    print(f"decode    ours/best-hf tokens/s = {results['decode']['ratio_vs_best_hf']:.2f}x "
          f"(target >= 2x)")
    print(f"cached    TTFT cached/cold = {results['cached_ttft']['ratio']:.3f}x "
          f"(target <= 0.15x)")


if __name__ == "__main__":
    main()

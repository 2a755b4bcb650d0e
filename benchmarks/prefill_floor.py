r"""Where one cold prefill step of the serving model goes, op by op, against FLOP floors.

    .venv/bin/python benchmarks/prefill_floor.py [--tokens 2048] [--threads 1] [--reps 7]

The serving model's layer (`step_profile.PEER_SHAPE`: hidden 512, 8 heads / 2 KV heads of 64,
intermediate 1408; fp32), one prompt of `--tokens` tokens with no cached prefix: the four GEMMs
as the engine runs them at that row count (oneDNN's prepacked weights), the prompt attention
(`paged_prefill_attention` over a paged pool), the element-wise ops (`rms_norm`, `add_rms_norm`,
`rope_qkv_store`, `silu_mul`), the embedding gather and the one-row lm_head. Each repetition
runs every op once, back to back; printed per op: min and median ms (thread CPU time on one
thread, which other processes on the core do not inflate; wall time otherwise), times the
number of layers where the op is per layer, and the floor: its FLOPs at the peak measured here
(`--peak`: the best GFLOP/s of a cache-resident oneDNN GEMM on this thread count, the practical
FMA peak), or for a memory-bound op nothing (bytes are printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import PEER_SHAPE  # noqa: E402

from kvcake.engine import cpu_ops  # noqa: E402
from kvcake.engine.linear import Kernel  # noqa: E402

CLOCKS = {"thread": time.thread_time, "process": time.process_time, "wall": time.perf_counter}


def _clock(threads: int, name: str = "auto") -> Callable[[], float]:
    """thread CPU time on one thread (other processes on the core do not inflate it), wall
    time otherwise; `process`: CPU time of all threads (what the op's threads spent, spinning
    at barriers included)."""
    if name == "auto":
        name = "thread" if threads == 1 else "wall"
    return CLOCKS[name]


def peak_gflops(threads: int, reps: int = 30) -> float:
    """Best GFLOP/s of a small oneDNN GEMM whose operands stay in cache (the FMA peak that a
    blocked GEMM reaches on this CPU and thread count)."""
    clock, best = _clock(threads), 0.0
    for m, n, k in ((256, 256, 256), (512, 256, 256), (256, 512, 512)):
        kern = Kernel(torch.randn(n, k), None)
        kern.prepare("onednn")
        x = torch.randn(m, k)
        for _ in range(5):
            kern.run(x, "onednn")
        for _ in range(reps):
            t0 = clock()
            for _ in range(10):
                kern.run(x, "onednn")
            best = max(best, 2 * m * n * k * 10 / (clock() - t0) / 1e9)
    return best


def ops(tokens: int) -> list[tuple[str, int, float, Callable[[], object]]]:
    """(name, times per step, FLOPs per call, call) for one cold prefill step."""
    cfg = PEER_SHAPE
    d, hd, nh, nkv = cfg.hidden_size, cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    inter, vocab, layers, n = cfg.intermediate_size, cfg.vocab_size, cfg.num_layers, tokens
    f = cpu_ops.fused_ops()
    gen = torch.Generator().manual_seed(0)
    bs = 16
    blocks = (n + bs - 1) // bs
    kv = torch.randn(blocks + 8, 2, bs, nkv, hd, generator=gen)
    table = torch.arange(blocks)
    slots = torch.arange(n)
    k_slots = (slots // bs) * 2 * bs + slots % bs
    v_slots = k_slots + bs
    rows = kv.view(-1, nkv, hd)
    pos = torch.arange(n, dtype=torch.float32)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = emb.cos(), emb.sin()[:, :hd // 2].contiguous()
    h, delta = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    w = torch.ones(d)
    q = torch.randn(n, nh, hd, generator=gen) * 0.3
    qkv_out = torch.randn(n, (nh + 2 * nkv) * hd, generator=gen)
    gate_up = torch.randn(n, 2 * inter, generator=gen)
    embed = torch.randn(vocab, d, generator=gen)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    out: list[tuple[str, int, float, Callable[[], object]]] = []
    for name, (o, i) in {"qkv_proj": ((nh + 2 * nkv) * hd, d), "o_proj": (d, nh * hd),
                         "gate_up_proj": (2 * inter, d), "down_proj": (d, inter)}.items():
        kern = Kernel(torch.randn(o, i, generator=gen) * 0.02, None)
        kern.prepare("onednn")
        x = torch.randn(n, i, generator=gen)
        out.append((name, layers, 2.0 * n * o * i,
                    lambda kern=kern, x=x: kern.run(x, "onednn")))
    pairs = n * (n + 1) / 2  # causal: each query position attends to itself and those before
    out.append(("prefill_attention", layers, 2 * 2 * pairs * nh * hd,
                lambda: f.paged_prefill_attention(q, kv, table, n, hd ** -0.5)))
    out.append(("rope_qkv_store", layers, 0.0,
                lambda: f.rope_qkv_store(qkv_out, cos, sin, rows, k_slots, v_slots, nh, nkv)))
    out.append(("add_rms_norm", 2 * layers - 1, 0.0, lambda: f.add_rms_norm(h, delta, w, 1e-5)))
    out.append(("rms_norm", 1, 0.0, lambda: f.rms_norm(h, w, 1e-5)))
    out.append(("silu_mul", layers, 0.0, lambda: f.silu_mul(gate_up)))
    out.append(("embedding", 1, 0.0, lambda: torch.nn.functional.embedding(ids, embed)))
    head = Kernel(torch.randn(vocab, d, generator=gen) * 0.02, None)
    for backend in ("mkl_split", "mkl_gemv"):
        try:
            head.prepare(backend)
            head.choice = [backend] + ["onednn"] * 6
            break
        except RuntimeError:
            continue
    last = torch.randn(1, d, generator=gen)
    out.append(("lm_head (1 row)", 1, 2.0 * vocab * d, lambda: head(last)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--clock", choices=["auto", *CLOCKS], default="auto",
                    help="auto: thread CPU time on one thread, wall time on more")
    ap.add_argument("--peak", type=float, default=0.0,
                    help="GFLOP/s for the floors (0: measure it here)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.threads < 1 or args.reps < 1:
        ap.error("--tokens, --threads and --reps must be >= 1")
    if not cpu_ops.load():
        print(f"kvcake CPU ops did not build: {cpu_ops.load_error()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    clock = _clock(args.threads, args.clock)
    peak = args.peak or peak_gflops(args.threads)
    table = ops(args.tokens)
    times: dict[str, list[float]] = {name: [] for name, *_ in table}
    for _ in range(args.reps + 1):  # the first round warms up
        for name, _, _, call in table:
            t0 = clock()
            call()
            times[name].append(1e3 * (clock() - t0))
    kind = {"thread": "thread CPU", "process": "process CPU", "wall": "wall"}[
        args.clock if args.clock != "auto" else ("thread" if args.threads == 1 else "wall")]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load avg "
          f"{os.getloadavg()[0]:.2f}, {args.threads} thread(s), cold {args.tokens}-token "
          f"prefill, {kind} ms, peak {peak:.1f} GFLOP/s (cache-resident oneDNN GEMM)")
    print("| op | x per step | ms a call, min / median | ms a step (median) | floor ms a step "
          "| floor / median |")
    print("|---|---|---|---|---|---|")
    total = floor_total = 0.0
    for name, count, flops, _ in table:
        ts = times[name][1:]
        med = statistics.median(ts)
        floor = count * flops / peak / 1e6
        total += count * med
        floor_total += floor
        ratio = f"{floor / (count * med):.2f}" if flops else "-"
        print(f"| {name} | {count} | {min(ts):.2f} / {med:.2f} | {count * med:.1f} | "
              f"{floor:.1f} | {ratio} |")
    print(f"| total | | | {total:.1f} | {floor_total:.1f} | {floor_total / total:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

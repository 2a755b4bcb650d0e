r"""`paged_prefill_attention` against an earlier revision of the same op and torch's SDPA,
interleaved in one process (the machine is shared: wall times swing between runs).

    .venv/bin/python benchmarks/prefill_attention_bench.py [--base REV] [--threads 1] [--reps 7]

The op of revision `--base` (default HEAD) is compiled from `git show REV:...` under another
library name (`torch.ops.kvcake_base`), next to the working tree's op (`cpu_ops.load()`), with the
same compiler and flags. Shapes: the serving model's layer (8 heads / 2 KV heads / 64) on a cold
2,048-token prompt and on a 300-token chunk after 2,048 cached tokens, and a head size 128 case.
Each repetition runs base, new and SDPA (gathered K/V, causal mask) back to back; printed per
shape: min and median milliseconds, per thread CPU time on one thread (immune to other processes
on the core) else wall, the new/base ratio, and the largest difference between base and new.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcake.engine import cpu_ops

CSRC = "kvcake/engine/csrc"
SHAPES = {  # name: (heads, kv_heads, head_size, ctx_len, q_len)
    "cold-2048": (8, 2, 64, 2048, 2048),
    "prefix-2048+300": (8, 2, 64, 2348, 300),
    "cold-1024-d128": (8, 2, 128, 1024, 1024),
}


def build_base(rev: str, out: Path) -> None:
    """Compile the ops of `rev` (a git revision; or a prefill_attention.cpp file, an experiment,
    with the rest from the working tree) as library `kvcake_base` and load it."""
    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parent.parent
    names = [s.name for s in cpu_ops.SOURCES]
    for name in (*names, "fast_exp.h"):
        if Path(rev).is_file():
            path = Path(rev) if name == "prefill_attention.cpp" else root / CSRC / name
            text = path.read_text()
        else:
            text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=root,
                                  check=True, capture_output=True, text=True).stdout
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
            text = text.replace(f"{macro}(kvcake,", f"{macro}(kvcake_base,")
        (out / name).write_text(text)
    lib = out / "base.so"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    dirs = cpp_extension.library_paths()
    cmd = [os.environ.get("CXX") or "c++", *cpu_ops.FLAGS, abi, f"-I{out}",
           *[f"-I{p}" for p in cpp_extension.include_paths()], *[str(out / n) for n in names],
           *[f"-L{d}" for d in dirs], *[f"-Wl,-rpath,{d}" for d in dirs], "-lc10", "-ltorch_cpu",
           "-o", str(lib)]
    subprocess.run(cmd, check=True)
    torch.ops.load_library(str(lib))


def inputs(shape: tuple[int, int, int, int, int], seed: int = 0):
    heads, kv_heads, d, ctx, n = shape
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-ctx // 16)
    kv = torch.randn(blocks + 8, 2, 16, kv_heads, d, generator=gen)
    table = torch.randperm(blocks + 8, generator=gen)[:blocks]
    q = torch.randn(n, heads, d, generator=gen)
    return q, kv, table, ctx


def sdpa(q, kv, table, ctx):
    """The engine's fallback: gather K/V, then SDPA ([1, H, n, D], GQA; causal or masked)."""
    _, _, bs, hkv, d = kv.shape
    rows = kv.reshape(-1, hkv, d)
    pos = torch.arange(ctx)
    k_rows = table[pos // bs] * 2 * bs + pos % bs
    ks = rows[k_rows].transpose(0, 1).unsqueeze(0)
    vs = rows[k_rows + bs].transpose(0, 1).unsqueeze(0)
    n = q.shape[0]
    mask = None if n == ctx else pos[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), ks, vs,
                                          attn_mask=mask, is_causal=mask is None, scale=d**-0.5,
                                          enable_gqa=True)[0].transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sdpa", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_ops.load(), cpu_ops.load_error()
    with tempfile.TemporaryDirectory() as tmp:
        build_base(args.base, Path(tmp))
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    what = "thread CPU ms" if args.threads == 1 else "wall ms"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f},"
          f" {args.threads} thread(s), {what}, min / median of {args.reps}, base {args.base}")
    print("| shape | base | new | new/base (min, median) | SDPA | max abs diff |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        print(bench_shape(name, args, clock))

def bench_shape(name: str, args: argparse.Namespace, clock) -> str:
    """One table row: base, new (and SDPA) interleaved on shape `name`."""
    q, kv, table, ctx = inputs(SHAPES[name])
    scale = q.shape[-1] ** -0.5
    fns = {"base": lambda: torch.ops.kvcake_base.paged_prefill_attention(q, kv, table, ctx,
                                                                        scale),
           "new": lambda: cpu_ops.paged_prefill_attention(q, kv, table, ctx, scale)}
    if not args.no_sdpa:
        fns["sdpa"] = lambda: sdpa(q, kv, table, ctx)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(args.reps):
        for key, fn in fns.items():
            t0 = clock()
            fn()
            times[key].append(1e3 * (clock() - t0))
    diff = (fns["base"]() - fns["new"]()).abs().max().item()
    mn = {k: min(v) for k, v in times.items()}
    md = {k: statistics.median(v) for k, v in times.items()}
    sd = f"{mn['sdpa']:.1f} / {md['sdpa']:.1f}" if "sdpa" in fns else "-"
    return (f"| {name} | {mn['base']:.1f} / {md['base']:.1f} | {mn['new']:.1f} / "
            f"{md['new']:.1f} | {mn['new'] / mn['base']:.3f}, {md['new'] / md['base']:.3f} | "
            f"{sd} | {diff:.2e} |")

if __name__ == "__main__":
    main()

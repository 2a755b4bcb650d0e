"""A decode-sized fp32 GEMM (an lm_head: vocab x hidden, a few rows) through the BLAS backends a
CPU engine could use, side by side in one run: torch's `F.linear` (MKL in the CPU wheel),
`W @ x^T` (the orientation kvcake's model uses for small batches), oneDNN
(`torch.utils.mkldnn.to_mkldnn` of the layer) and numpy's OpenBLAS.

    .venv/bin/python benchmarks/gemv_backends.py [--vocab 32000] [--hidden 512] [--rows 1,16]
        [--threads 2] [--calls 60]

Prints ms per call and the weight bytes read per second (the bound for a GEMV).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.mkldnn as mkldnn_utils
from torch import nn


def _ms(step: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = nn.Linear(args.hidden, args.vocab, bias=False)
    weight = layer.weight.detach()
    onednn = mkldnn_utils.to_mkldnn(layer)  # the same weights, reordered for oneDNN
    weight_np = weight.numpy()
    weight_gb = weight.numel() * 4 / 1e9
    print(f"{args.vocab} x {args.hidden} fp32 ({weight_gb * 1e3:.0f} MB), {args.threads} torch "
          f"threads, {args.calls} calls, load avg {os.getloadavg()[0]:.1f}; "
          f"{torch.__config__.show().splitlines()[3].strip()}")
    print("| rows | F.linear (MKL) | W @ x^T | oneDNN | numpy (OpenBLAS) | best / F.linear |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden)
        x_np = x.numpy()
        steps: list[Callable[[], object]] = [
            lambda x=x: F.linear(x, weight),
            lambda x=x: (weight @ x.T).T,
            lambda x=x: onednn(x.to_mkldnn()).to_dense(),
            lambda x_np=x_np: torch.from_numpy(x_np @ weight_np.T)]
        with torch.no_grad():
            times = [_ms(step, args.calls) for step in steps]
        cells = " | ".join(f"{t:.2f} ms ({weight_gb / (t / 1e3):.1f} GB/s)" for t in times)
        print(f"| {rows} | {cells} | {min(times) / times[0]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""The layer hook's own cost: one transfer request per block (before) vs one per run of blocks
consecutive in both pools (`block_runs`, now), same run, same bytes.

    .venv/bin/python benchmarks/kv_hook_cost.py [--prompt-tokens 1500] [--prompts 20]

What a prefill worker's layer hook does for one prompt, without the model: for every layer,
build and submit the WRITEs of that layer of the prompt's blocks into a decode pool (a shared-
memory segment of another transfer engine, the same-host path), then wait for all of them at
the end. Measured per prompt, modes interleaved: the engine-thread time spent building and
submitting (what the hook adds to prefill compute), the time to completion, the request count.
Target layouts: `contiguous` (a fresh decode pool: the reserved blocks are consecutive) and
`fragmented` (every other block: no run longer than one, the worst case for runs).
Model shape: `small` (12 layers, 4 KV heads x 64, block 16, fp32: 32 KiB per block-layer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from kvcake.server.worker.kv_runs import block_runs
from kvcake.transfer import TransferConfig, TransferEngine, TransferOp, TransferRequest

LAYERS, BLOCK, HEADS, HEAD_DIM = 12, 16, 4, 64


def one_prompt(transfer: TransferEngine, src_pool: torch.Tensor, desc: object, pool_blocks: int,
               src: list[int], dst: list[int], coalesce: bool) -> tuple[float, float, int]:
    layer_nbytes = src_pool[0, 0].numel() * src_pool.element_size()
    t0 = time.perf_counter()
    hook_s = 0.0
    batches = []
    count = 0
    for layer in range(LAYERS):
        h0 = time.perf_counter()
        if coalesce:
            reqs = [TransferRequest(TransferOp.WRITE, src_pool[layer, s:s + n], desc,
                                    (layer * pool_blocks + d) * layer_nbytes)
                    for s, d, n in block_runs(src, dst, 0, len(src))]
        else:
            reqs = [TransferRequest(TransferOp.WRITE, src_pool[layer, s], desc,
                                    (layer * pool_blocks + d) * layer_nbytes)
                    for s, d in zip(src, dst, strict=True)]
        batches.append(transfer.submit(reqs))
        hook_s += time.perf_counter() - h0
        count += len(reqs)
    for b in batches:
        transfer.wait(b, 30).raise_for_failure()
    return hook_s, time.perf_counter() - t0, count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--prompts", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    blocks = -(-args.prompt_tokens // BLOCK)
    pool_blocks = 2 * blocks + 2
    src_pool = torch.randn(LAYERS, pool_blocks, 2, BLOCK, HEADS, HEAD_DIM)
    layer_nbytes = src_pool[0, 0].numel() * 4
    layouts = {"contiguous": (list(range(blocks)), list(range(1, blocks + 1))),
               "fragmented": (list(range(blocks)), list(range(0, 2 * blocks, 2)))}
    out: dict[str, dict[str, float]] = {}
    load = os.getloadavg()
    with TransferEngine(TransferConfig(port=0)) as decode, \
            TransferEngine(TransferConfig(port=0)) as prefill:
        desc = decode.allocate_segment("pool", LAYERS * pool_blocks * layer_nbytes)
        view = decode.segment("pool").array
        for layout, (src, dst) in layouts.items():
            samples: dict[str, list[tuple[float, float, int]]] = {"per_block": [], "runs": []}
            for i in range(args.prompts + 1):  # the first of each mode warms up
                for mode in ("per_block", "runs"):
                    r = one_prompt(prefill, src_pool, desc, pool_blocks, src, dst,
                                   mode == "runs")
                    if i:
                        samples[mode].append(r)
            probe = (LAYERS - 1) * pool_blocks + dst[-1]  # last layer, last block: bytes arrived
            got = torch.frombuffer(bytearray(view[probe * layer_nbytes:(probe + 1)
                                                  * layer_nbytes]), dtype=torch.float32)
            assert torch.equal(got, src_pool[LAYERS - 1, src[-1]].flatten())
            for mode, rs in samples.items():
                out[f"{layout}/{mode}"] = {
                    "requests_per_prompt": rs[0][2],
                    "hook_ms_median": round(1000 * statistics.median(r[0] for r in rs), 3),
                    "total_ms_median": round(1000 * statistics.median(r[1] for r in rs), 3)}
    result = {"prompt_tokens": args.prompt_tokens, "blocks": blocks, "layers": LAYERS,
              "mib_per_prompt": round(LAYERS * blocks * layer_nbytes / 2**20, 2),
              "modes": out,
              "hook_ratio_runs_vs_per_block": {
                  lay: round(out[f"{lay}/runs"]["hook_ms_median"]
                             / out[f"{lay}/per_block"]["hook_ms_median"], 3) for lay in layouts},
              "loadavg": [round(v, 2) for v in load]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

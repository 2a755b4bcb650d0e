"""What the HTTP frontend costs: the same prompts through `kvcake serve` vs offline `kvcake.LLM`.

Peer: the engine driven directly (offline batch generation, no HTTP, no threads). Both sides
run torch with one intra-op thread (`torch.set_num_threads(1)` here, OMP_NUM_THREADS=1 for the
server): on a contended 2-core machine two spinning OpenMP threads make the main-thread engine
~10x slower, which would flatter the server. Ours: a real
`kvcake serve --mode colocated` subprocess, driven by concurrent streaming httpx clients. Same
model (tiny preset, same seed: same weights), same prompts, greedy, exact output lengths; the
generated tokens must be identical, and the ratios say what the serving path costs.

    .venv/bin/python benchmarks/api_overhead.py [--num-prompts 32] [--prompt-len 200] [--output-len 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import torch

from kvcake import LLM, SamplingParams
from kvcake.engine.config import EngineConfig


def offline(prompts: list[list[int]], output_len: int) -> tuple[float, float, list[list[int]]]:
    llm = LLM("tiny", config=EngineConfig(kv_cache_bytes=64 * 2**20,
                                          enable_prefix_caching=False))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    batch_s = time.perf_counter() - start
    start = time.perf_counter()
    for p in prompts[:8]:
        llm.generate([p], params)
    single_s = (time.perf_counter() - start) / 8
    return batch_s, single_s, [o.token_ids for o in outs]


async def served(url: str, prompts: list[list[int]],
                 output_len: int) -> tuple[float, float, list[list[int]]]:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as http:
        async def one(prompt: list[int]) -> list[int]:
            reply = await http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True})
            reply.raise_for_status()
            return list(reply.json()["choices"][0]["token_ids"])

        await asyncio.gather(*(one(p) for p in prompts[:2]))  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        batch_s = time.perf_counter() - start
        start = time.perf_counter()
        for p in prompts[:8]:
            await one(p)
        single_s = (time.perf_counter() - start) / 8
    return batch_s, single_s, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=args.prompt_len).tolist()
               for _ in range(args.num_prompts)]
    proc = subprocess.Popen([sys.executable, "-m", "kvcake", "serve", "--port", "0",
                             "--kv-cache-bytes", "64MiB", "--no-prefix-caching"],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"http://\S+:\d+", line)
        if match is None:
            raise SystemExit(f"kvcake serve did not start: {line}")
        served_batch_s, served_single_s, served_tokens = asyncio.run(
            served(match.group(0), prompts, args.output_len))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    offline_batch_s, offline_single_s, offline_tokens = offline(prompts, args.output_len)
    num_tokens = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} tokens "
          f"each, tiny preset, greedy, prefix caching off")
    print(f"tokens identical: {served_tokens == offline_tokens}")
    print(f"{'':28}{'offline LLM':>14}{'kvcake serve':>14}{'ratio':>8}")
    print(f"{'batch output tok/s':28}{num_tokens / offline_batch_s:14.1f}"
          f"{num_tokens / served_batch_s:14.1f}{offline_batch_s / served_batch_s:8.2f}")
    print(f"{'one request latency (ms)':28}{offline_single_s * 1000:14.1f}"
          f"{served_single_s * 1000:14.1f}{served_single_s / offline_single_s:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the HTTP frontend costs: the same prompts through `kvcake serve` vs offline `kvcake.LLM`.

Peer: the engine driven directly (offline batch generation, no HTTP, no threads). Ours: a real
`kvcake serve --mode single` subprocess, driven by concurrent httpx clients. Same model (tiny
preset, same seed: same weights), same prompts, greedy, exact output lengths; the generated
tokens must be identical. Both sides run torch with one intra-op thread
(`torch.set_num_threads(1)` here, `--num-threads 1` for the server): on a contended 2-core
machine two spinning OpenMP threads made the main-thread engine ~10x slower, which would flatter
the server. The two sides alternate, `--repeats` times, and the medians are reported, so a
change in the machine's load during the run hits both.

    .venv/bin/python benchmarks/api_overhead.py [--num-prompts 32] [--prompt-len 200]
        [--output-len 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
import torch

from kvcake import LLM, SamplingParams
from kvcake.engine.config import EngineConfig

ENGINE = EngineConfig(kv_cache_bytes=64 * 2**20, enable_prefix_caching=False)


def timed_offline(llm: LLM, prompts: list[list[int]],
                  params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


async def timed_served(url: str, prompts: list[list[int]], output_len: int,
                       concurrent: bool) -> tuple[float, list[list[int]]]:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as http:
        async def one(prompt: list[int]) -> list[int]:
            reply = await http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True})
            reply.raise_for_status()
            return list(reply.json()["choices"][0]["token_ids"])

        start = time.perf_counter()
        if concurrent:
            tokens = list(await asyncio.gather(*(one(p) for p in prompts)))
        else:
            tokens = [await one(p) for p in prompts]
        return time.perf_counter() - start, tokens


def start_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvcake", "serve", "--port", "0",
                             "--mode", "single", "--kv-cache-bytes", "64MiB", "--no-prefix-caching",
                             "--num-threads", "1"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    match = re.search(r"http://\S+:\d+", line)
    if match is None:
        proc.terminate()
        raise SystemExit(f"kvcake serve did not start: {line}")
    return proc, match.group(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=args.prompt_len).tolist()
               for _ in range(args.num_prompts)]
    singles = prompts[:4]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm = LLM("tiny", config=ENGINE)
    proc, url = start_server()
    times: dict[str, list[float]] = {k: [] for k in ("off_b", "srv_b", "off_1", "srv_1")}
    try:
        asyncio.run(timed_served(url, prompts[:2], args.output_len, True))  # warm-ups
        timed_offline(llm, prompts[:2], params)
        same = True
        for _ in range(args.repeats):
            t, served = asyncio.run(timed_served(url, prompts, args.output_len, True))
            times["srv_b"].append(t)
            t, offline = timed_offline(llm, prompts, params)
            times["off_b"].append(t)
            same = same and served == offline
            times["srv_1"].append(asyncio.run(
                timed_served(url, singles, args.output_len, False))[0] / len(singles))
            times["off_1"].append(sum(timed_offline(llm, [p], params)[0] for p in singles)
                                  / len(singles))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    med = {k: statistics.median(v) for k, v in times.items()}
    num_tokens = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} tokens "
          f"each, tiny preset, greedy, prefix caching off, median of {args.repeats}")
    print(f"tokens identical: {same}")
    print(f"{'':30}{'offline LLM':>13}{'kvcake serve':>14}{'serve/offline':>15}")
    print(f"{'batch output tok/s':30}{num_tokens / med['off_b']:13.1f}"
          f"{num_tokens / med['srv_b']:14.1f}{med['off_b'] / med['srv_b']:15.2f}")
    print(f"{'one request at a time (ms)':30}{med['off_1'] * 1000:13.1f}"
          f"{med['srv_1'] * 1000:14.1f}{med['srv_1'] / med['off_1']:15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

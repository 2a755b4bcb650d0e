r"""TTFT of one long prompt: a chunked-pipeline-parallel (CPP) group of 2 prefill workers vs one
prefill worker, same run, same weights, same prompt.

    .venv/bin/python benchmarks/cpp_prefill.py                       # 16k tokens, `small` shape
    .venv/bin/python benchmarks/cpp_prefill.py --prompt-tokens 4096 --chunk-tokens 1024

Systems (one at a time, never two at once; each in its own processes, loaded, warmed up on a
short prompt, then timed on the long one):
- `cpp2`: `CppGroup` of 2 member processes, 1 torch thread each, each holding half the layers
  (`StageEngine`); the prompt in chunks of `--chunk-tokens` flows member 1 -> member 2 (member 2
  runs chunk i while member 1 runs chunk i+1), hidden states through the transfer engine (a
  shared-memory inbox segment of member 2). TTFT: first chunk sent -> first token received.
- `single1`: one prefill engine (`Engine`, prefill-only, chunked prefill at the engine's token
  budget `--single-budget`), 1 thread. TTFT: `add_request` -> the step that samples.
- `single2`: the same with 2 threads (the same 2 cores as cpp2, in one process).
- `live_cpp2`: the served path: a cluster as `kvcake serve --prefill 1 --decode 1 --cpp-nodes 2`
  starts it (worker processes, 1 thread each, the Conductor in this process); the prompt goes
  to the CPP group (`--cpp-min-tokens` = the warm-up's length), which streams its KV into the
  decode worker's reserved blocks. TTFT: `generate` -> the first token event (reservation,
  pipelined prefill, every stage's KV writes, one request of max_tokens 1).
- `live_single1`: the same cluster without the group: the plain prefill worker (1 thread).
- `--cached-prefix-tokens P` (live systems): after the long prompt (max_tokens 1: every stage
  of a group stores its layers of the prompt's blocks, as a plain prefill worker stores its
  prompt), wait until the store holds its first P tokens, then time a prompt of the same length
  sharing them (fresh tokens after): the group fetches the prefix (each stage only its layers'
  slice objects) and pipelines only the new tokens; the plain worker reuses its own cache.
  Reported under `cached_prefix` (TTFT, cached tokens, ratio to the cold prompt of the same
  system, first tokens equal across systems) with `stages`: per prefill worker (each stage of
  a group), seconds from `generate` to its first chunk (the decode reservation, the order, the
  prefix fetch and import), its compute, its fetch (bytes, seconds) and when its report came.

Model: the `small` preset's shape (d 768, 12 layers, GQA 12:4, vocab 32000) with its context
raised to `--context` (16k tokens do not fit the preset's 8,192), seeded random weights written
to a temporary Hugging Face directory that every system loads. Ideal CPP ratio with J chunks and
X members: (J + X - 1) / (J X) of one worker's time (here J = 16, X = 2: 0.53); the target is
<= 0.65x single1. Prints one JSON object: `ttft_s` per system, `ratio_vs_single1`,
`tokens_equal` (the first token of every system equal), the member compute times, the load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvcake.engine.config import PRESETS, EngineConfig
from kvcake.engine.loader import dummy_weights, save_hf_dir
from kvcake.server.worker.cpp_group import CppGroup, CppGroupConfig

WARMUP_TOKENS = 512


def write_model(path: Path, context: int, seed: int, shape: str = "small") -> None:
    config = dataclasses.replace(PRESETS[shape], name=f"{shape}-long",
                                 max_position_embeddings=context)
    save_hf_dir(config, dummy_weights(config, seed), path)


def engine_config(prompt_tokens: int, budget: int) -> EngineConfig:
    # KV room for the prompt and the warm-up (small: 24 KiB per token in fp32), plus slack.
    return EngineConfig(device="cpu", kv_cache_bytes=(prompt_tokens + 4 * WARMUP_TOKENS) * 24576,
                        max_num_batched_tokens=budget)


def _single_main(model: str, threads: int, config: EngineConfig, prompts: list[list[int]],
                 conn: Connection) -> None:
    import torch

    torch.set_num_threads(threads)
    from kvcake.engine.engine import Engine

    engine = Engine(model, config)
    out = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", prompt, prefill_only=True)
        token = None
        while token is None:
            for o in engine.step():
                token = o.new_token_ids[0]
        out.append((token, time.perf_counter() - t0))
        engine.release(f"r{i}")
    conn.send(out)


def run_single(model: str, threads: int, config: EngineConfig,
               prompts: list[list[int]]) -> list[tuple[int, float]]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_single_main, args=(model, threads, config, prompts, there))
    proc.start()
    result: list[tuple[int, float]] = here.recv()
    proc.join()
    return result


def run_cpp(model: str, members: int, config: EngineConfig, chunk_tokens: int,
            prompts: list[list[int]]) -> tuple[list[tuple[int, float]], list[float]]:
    out = []
    with CppGroup(model, members, config, CppGroupConfig(chunk_tokens, threads=1)) as group:
        for i, prompt in enumerate(prompts):
            r = group.prefill(f"r{i}", prompt)
            out.append((r.first_token, r.ttft_s))
    return out, list(r.compute_s)


def run_live(model: str, members: int, config: EngineConfig, chunk_tokens: int,
             prompts: list[list[int]], profile_dir: str,
             cached: list[int] | None = None, prefix_tokens: int = 0,
             ) -> tuple[list[tuple[int, float]],
                        tuple[int, float, int, dict[str, dict[str, float]]] | None]:
    """TTFT of each prompt through a served cluster (worker processes): with a CPP group of
    `members` stages (every prompt from the first's length up goes to it), or none (0). With
    `cached`: then (first token, TTFT, cached tokens, where the time went) of that prompt, sent
    once the store holds the last prompt's first `prefix_tokens`."""
    import asyncio

    from kvcake.conductor import ConductorConfig
    from kvcake.hashing import block_keys
    from kvcake.server.cluster.config import ClusterConfig
    from kvcake.server.cluster.launcher import Cluster
    from kvcake.server.cluster.router import STORE_HOLDER
    from kvcake.server.frontend.backend import GenerateRequest
    from kvcake.server.worker.messages import Message, PrefillDone
    from kvcake.types import RequestId

    cpp = {"cpp_min_tokens": min(map(len, prompts)), "cpp_nodes": members,
           "cpp_chunk_tokens": chunk_tokens,
           "cpp_min_chunk_tokens": min(1000, chunk_tokens)} if members else {}  # --shape tiny
    worker: dict[str, Any] = {"num_threads": 1}
    if cached is not None:  # room in the store for the long prompt's KV (24 KiB a token)
        worker["store_dram_bytes"] = 2 * len(prompts[-1]) * 24576
    cluster_config = ClusterConfig.simple(
        1, 1, members, model=model, engine=config, profile_dir=profile_dir,
        worker=worker, conductor=ConductorConfig.from_dict({"admission": "none", **cpp}))
    out = []
    with Cluster(cluster_config) as cluster:
        backend = cluster.backend
        assert backend is not None and backend.conductor is not None

        async def first_token(rid: str, prompt: list[int],
                              max_tokens: int = 1) -> tuple[int, float, int]:
            t0 = time.perf_counter()
            stream = await backend.generate(GenerateRequest(RequestId(rid), tuple(prompt),
                                                            max_tokens, temperature=0.0,
                                                            ignore_eos=True))
            async for event in stream:
                ttft = time.perf_counter() - t0
                async for _ in stream:  # the rest (max_tokens 2: the decode worker's step)
                    pass
                return event.token_ids[0], ttft, event.num_cached_tokens
            raise RuntimeError(f"{rid}: no token")

        # max_tokens 1: a group's stages store the prompt themselves (cpp_role.py)
        for i, prompt in enumerate(prompts):
            token, ttft, _ = asyncio.run(first_token(f"live-{i}", prompt))
            out.append((token, ttft))
        if cached is None:
            return out, None
        keys = block_keys(prompts[-1][:prefix_tokens], config.block_size,
                          backend._hello().namespace)
        deadline = time.monotonic() + 300
        while backend.conductor.index.match(keys).blocks_by_holder.get(STORE_HOLDER, 0) \
                < len(keys):
            if time.monotonic() > deadline:
                raise RuntimeError("the store did not get the prefix in 300 s")
            time.sleep(0.2)
        # every prefill worker's report of the timed request, when it came (this clock)
        book = backend._book
        assert book is not None
        reports: dict[str, tuple[float, PrefillDone]] = {}
        on_message = book.on_message

        def record(worker_id: str, message: Message) -> None:
            if isinstance(message, PrefillDone) and message.request_id == "live-cached":
                reports[worker_id] = (time.perf_counter(), message)
            on_message(worker_id, message)

        book.on_message = record  # type: ignore[method-assign]
        t0 = time.perf_counter()
        token, ttft, num_cached = asyncio.run(first_token("live-cached", cached))
        book.on_message = on_message  # type: ignore[method-assign]
        stages = {w: {"first_chunk_at_s": round(at - t0 - d.transfer_span_s, 3),
                      "compute_s": round(d.compute_s, 3),
                      "fetch_mib": round(d.fetch_bytes / 2**20, 1),
                      "fetch_s": round(d.fetch_s, 3), "done_at_s": round(at - t0, 3)}
                  for w, (at, d) in sorted(reports.items())}
        return out, (token, ttft, num_cached, stages)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--context", type=int, default=32768, help="the model's max positions")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="CPP chunk size")
    p.add_argument("--single-budget", type=int, default=EngineConfig().max_num_batched_tokens,
                   help="the single worker's prefill chunk (engine token budget)")
    p.add_argument("--members", type=int, default=2)
    p.add_argument("--shape", default="small", choices=("small", "tiny"),
                   help="the preset whose shape the model has (tiny: a quick check of the code)")
    p.add_argument("--systems", default="single1,cpp2,single2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cached-prefix-tokens", type=int, default=0,
                   help="live systems: then a prompt sharing this many tokens with the long one")
    p.add_argument("--model-dir", type=Path, help="reuse this directory (written if absent)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.prompt_tokens >= args.context:
        sys.exit(f"--prompt-tokens {args.prompt_tokens}: must be below --context {args.context}")
    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="kvcake-cpp-"))
        model_dir = tmp / "model"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, args.context, args.seed, args.shape)
    rng = random.Random(args.seed)
    vocab = PRESETS[args.shape].vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)]
               for n in (WARMUP_TOKENS, args.prompt_tokens)]
    config = engine_config(args.prompt_tokens, args.single_budget)
    prefix = args.cached_prefix_tokens
    if not 0 <= prefix < args.prompt_tokens:
        sys.exit(f"--cached-prefix-tokens {prefix}: must be in [0, --prompt-tokens)")
    cached_prompt = prompts[-1][:prefix] + [rng.randrange(vocab)
                                           for _ in range(args.prompt_tokens - prefix)]
    cached: dict[str, tuple[int, float, int, dict[str, dict[str, float]]]] = {}
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    compute: list[float] = []
    try:
        for system in args.systems.split(","):
            t0 = time.perf_counter()
            if system.startswith("single"):
                results[system] = run_single(str(model_dir), int(system[6:]), config, prompts)
            elif system.startswith("live_"):
                members = args.members if system == "live_cpp2" else 0
                results[system], again = run_live(
                    str(model_dir), members, config, args.chunk_tokens, prompts,
                    str(model_dir / "kvcake-profiles"), cached_prompt if prefix else None,
                    prefix)
                if again is not None:
                    cached[system] = again
                    print(f"# {system}: cached-prefix ttft {again[1]:.2f} s "
                          f"({again[2]} tokens cached)", file=sys.stderr, flush=True)
            elif system.startswith("cpp"):
                results[system], compute = run_cpp(str(model_dir), args.members, config,
                                                   args.chunk_tokens, prompts)
            else:
                sys.exit(f"--systems: unknown {system!r} (single1, single2, cpp2, live_cpp2, "
                         "live_single1)")
            print(f"# {system}: ttft {results[system][-1][1]:.2f} s "
                  f"(wall {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    ttft = {s: r[-1][1] for s, r in results.items()}
    first = {s: r[-1][0] for s, r in results.items()}
    j = -(-args.prompt_tokens // args.chunk_tokens)
    x = args.members
    out = {
        "prompt_tokens": args.prompt_tokens,
        "chunk_tokens": args.chunk_tokens,
        "single_budget": args.single_budget,
        "ttft_s": {s: round(v, 3) for s, v in ttft.items()},
        # the served path against the served plain worker, the in-process ones against single1
        "ratio_vs_single1": {s: round(v / ttft[base], 3) for s, v in ttft.items()
                             if (base := "live_single1" if s.startswith("live_") else "single1")
                             in ttft},
        "ideal_cpp_ratio": round((j + x - 1) / (j * x), 3),
        "cpp_member_compute_s": [round(c, 3) for c in compute],
        "tokens_equal": len(set(first.values())) == 1,
        "first_tokens": first,
        "loadavg_before": [round(v, 2) for v in load_before],
        **({"cached_prefix": {
            "prefix_tokens": prefix,
            "ttft_s": {s: round(c[1], 3) for s, c in cached.items()},
            "cached_tokens": {s: c[2] for s, c in cached.items()},
            "stages": {s: c[3] for s, c in cached.items()},
            "ratio_vs_cold": {s: round(c[1] / ttft[s], 3) for s, c in cached.items()},
            "ratio_vs_live_single1": {s: round(c[1] / cached["live_single1"][1], 3)
                                      for s, c in cached.items() if "live_single1" in cached},
            "tokens_equal": len({c[0] for c in cached.values()}) == 1,
        }} if cached else {}),
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

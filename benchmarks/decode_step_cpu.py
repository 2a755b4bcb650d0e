r"""CPU time of one engine's decode step, and of its decode attention op, at several batch sizes.

    .venv/bin/python benchmarks/decode_step_cpu.py [--model DIR] [--batches 32,24,16,8] [--json]

Offline, one thread, no server: --batches[0] prompts of 1,200-1,800 tokens (seeded) are prefilled,
then for each batch size (largest first; requests aborted down to it) --steps decode steps are
timed by the process's CPU time (not wall time: the 2-core machine is shared, and CPU time is what
the step costs its own core), together with the CPU time inside the paged decode attention op.
The default model is the one `serving_disagg_vs_colocated.py` serves (its --model-dir). To compare
two versions of the engine, run this file from each checkout with that checkout on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvcake.engine import model as model_mod
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/tmp/kvcake-vs-vllm-model")
    p.add_argument("--batches", default="32,24,16,8")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    batches = sorted((int(b) for b in args.batches.split(",")), reverse=True)
    torch.set_num_threads(1)
    engine = Engine(args.model, EngineConfig(dtype="float32", device="cpu",
                                             max_num_batched_tokens=2048,
                                             kv_cache_bytes=1 << 30))
    gen = torch.Generator().manual_seed(0)
    for i in range(batches[0]):
        prompt = torch.randint(4, engine.model_config.vocab_size, (1200 + (i * 37) % 600,),
                               generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    running = {f"r{i}" for i in range(batches[0])}
    outputs: dict[str, int] = {}
    while len(outputs) < len(running) or min(outputs.values()) < 2:  # all of them decoding
        for out in engine.step():
            outputs[out.request_id] = outputs.get(out.request_id, 0) + len(out.new_token_ids)
    in_op = [0.0]
    op = model_mod.paged_decode_attention

    def timed(*a: object) -> torch.Tensor:
        t0 = time.process_time()
        try:
            return op(*a)
        finally:
            in_op[0] += time.process_time() - t0

    model_mod.paged_decode_attention = timed  # type: ignore[assignment]
    rows = []
    for batch in batches:
        while len(running) > batch:
            rid = max(running)
            engine.abort(rid)
            running.discard(rid)
        engine.step()
        ctx = sum(len(engine.request_block_ids(r)) for r in running) * engine.pool.block_size
        cpu, att = [], []
        for _ in range(args.steps):
            in_op[0] = 0.0
            t0 = time.process_time()
            engine.step()
            cpu.append(time.process_time() - t0)
            att.append(in_op[0])
        order = sorted(range(len(cpu)), key=cpu.__getitem__)
        mid = order[len(order) // 2]
        rows.append({"batch": batch, "context_tokens_about": ctx,
                     "step_cpu_ms_p50": round(1e3 * cpu[mid], 2),
                     "step_cpu_ms_min": round(1e3 * cpu[order[0]], 2),
                     "attention_cpu_ms_at_p50": round(1e3 * att[mid], 2)})
        print(json.dumps(rows[-1]), flush=True)
    model_mod.paged_decode_attention = op
    report = {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "load_avg": os.getloadavg()[0], "engine": str(Path(model_mod.__file__).parent),
              "rows": rows}
    print(json.dumps(report) if args.json else f"load {report['load_avg']:.2f}, "
          f"engine {report['engine']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

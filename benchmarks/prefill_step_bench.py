r"""A prefill step of the engine with the ops of an earlier revision vs the working tree's,
interleaved in one process (the machine is shared: wall times swing between runs).

    .venv/bin/python benchmarks/prefill_step_bench.py [--base REV] [--threads 1] [--reps 5]
    .venv/bin/python benchmarks/prefill_step_bench.py --base all-rows --threads 2 --bind \
        --engine-thread --reps 9     # the last layer over every row (before) vs the logit rows

The serving model's shape (`step_profile.PEER_SHAPE`: Llama, hidden 512, 4 layers, 8 heads / 2
KV heads, fp32, seeded random weights). Two steps: a cold 2,048-token prompt, and a 300-token
chunk after a cached 2,048-token prefix (the agent trace's follow-ups). The C++ ops of `--base`
(default HEAD; see `prefill_attention_bench.build_base`) are swapped in for the working tree's
by rebinding `cpu_ops.fused_ops()`; every repetition runs base then new on fresh prompts. With
one thread the clock is the thread's CPU time (immune to other processes), else wall time. Also
printed: the process's minor page faults per step (median) and the paired ratio (median of
new / base over the repetitions). `--base all-rows`: base is the working tree with its last
layer computed for every row and the logit rows selected afterwards (as before the last layer
computed the logit rows only); a decode step of the finished prompts is compared too.
`--bind` binds torch's threads one per CPU as `kvcake serve` does (`--bind-threads`). The heap policy (`engine/heap.py`)
is process-wide, so it is compared across processes: `KVCAKE_MALLOC_TUNING=0` turns it off;
`--engine-thread` steps the engine from a thread started after it, as `kvcake serve` does (glibc
gives such a thread its own malloc arena unless the policy is on).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from prefill_attention_bench import build_base
from step_profile import PEER_SHAPE, _prompt

from kvcake.engine import cpu_ops, heap
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.loader import dummy_weights, save_hf_dir
from kvcake.engine.model import DecoderLayer
from kvcake.engine.sampling import SamplingParams

OPS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_qkv_store", "paged_decode_attention",
       "paged_prefill_attention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine-thread", action="store_true")
    ap.add_argument("--bind", action="store_true", help="torch's threads bound one per CPU")
    args = ap.parse_args()
    assert cpu_ops.load(), cpu_ops.load_error()
    with tempfile.TemporaryDirectory() as tmp:
        if args.base != ALL_ROWS:
            build_base(args.base, Path(tmp))
        save_hf_dir(PEER_SHAPE, dummy_weights(PEER_SHAPE, 0), Path(tmp))
        engine = Engine(tmp, EngineConfig(dtype="float32", device="cpu",
                                          max_num_batched_tokens=2048))
    if args.engine_thread:
        worker = threading.Thread(target=measure, args=(args, engine))
        worker.start()
        worker.join()
    else:
        measure(args, engine)


ALL_ROWS = "all-rows"
LOGIT_ROWS_ONLY = DecoderLayer._forward_fused_rows


def _every_row(self: DecoderLayer, h: torch.Tensor, pending: torch.Tensor | None,
               rope: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, batch: object,
               rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer as before: every row computed, the logit rows selected afterwards."""
    h, delta = self._forward_fused(h, pending, *rope, kv, batch)  # type: ignore[arg-type]
    return h[rows], delta[rows]


def measure(args: argparse.Namespace, engine: Engine) -> None:
    torch.set_num_threads(args.threads)  # per thread (OpenMP)
    if args.bind:
        print("bound to CPUs", cpu_ops.bind_threads(list(range(args.threads))))
    ns = cpu_ops.fused_ops()
    new_ops = {k: getattr(ns, k) for k in OPS}
    if args.base == ALL_ROWS:
        ops = {"new": (new_ops, LOGIT_ROWS_ONLY), "base": (new_ops, _every_row)}
    else:
        ops = {"new": (new_ops, LOGIT_ROWS_ONLY),
               "base": ({k: getattr(torch.ops.kvcake_base, k).default for k in OPS},
                        LOGIT_ROWS_ONLY)}

    def use(variant: str) -> None:
        table, last_layer = ops[variant]
        vars(ns).update(table)
        DecoderLayer._forward_fused_rows = last_layer  # type: ignore[method-assign]
    vocab = PEER_SHAPE.vocab_size
    prefix = _prompt(2048, 7, vocab)
    counter = iter(range(10**6))

    faults: list[int] = []
    decode_ms: list[float] = []
    two = SamplingParams(max_tokens=2, ignore_eos=True)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    def step(tokens: list[int]) -> float:
        engine.add_request(f"r{next(counter)}", tokens, two)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = clock()
        engine.step()
        elapsed = clock() - t0
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        t0 = clock()
        engine.step()  # the decode step of its second token
        decode_ms.append(1e3 * (clock() - t0))
        while engine.has_unfinished():
            engine.step()
        return 1e3 * elapsed

    cases = {"cold 2,048": lambda i: _prompt(2048, 1000 + i, vocab),
             "2,048 cached + 300": lambda i: prefix + _prompt(300, 5000 + i, vocab)}
    step(prefix)  # caches the prefix; warms both paths
    for variant in ops:
        use(variant)
        step(_prompt(2048, 3, vocab))
    times: dict[tuple[str, str], list[float]] = {(c, v): [] for c in cases for v in ops}
    decode: dict[str, list[float]] = {v: [] for v in ops}
    faults.clear()
    for i in range(args.reps):
        for case, make in cases.items():
            for variant in ("base", "new"):
                use(variant)
                times[case, variant].append(step(make(2 * i + (variant == "new"))))
                decode[variant].append(decode_ms[-1])
    use("new")
    what = "thread CPU ms" if args.threads == 1 else "wall ms"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{os.getloadavg()[0]:.2f}, {args.threads} thread(s), {what} of the prefill step, "
          f"min / median of {args.reps}, base {args.base}; engine "
          f"{'thread' if args.engine_thread else 'in the main thread'}, heap policy "
          f"{'on' if heap.keep_freed_memory() else 'off'}, minor page faults a step (median) "
          f"{statistics.median(faults):.0f}")
    print("| step | base | new | new/base (min, median) | paired median |\n|---|---|---|---|---|")
    rows = {case: (times[case, "base"], times[case, "new"]) for case in cases}
    rows["decode, 2k context"] = (decode["base"], decode["new"])
    for case, (b, n) in rows.items():
        paired = statistics.median(y / x for x, y in zip(b, n, strict=True))
        print(f"| {case} | {min(b):.1f} / {statistics.median(b):.1f} | {min(n):.1f} / "
              f"{statistics.median(n):.1f} | {min(n) / min(b):.3f}, "
              f"{statistics.median(n) / statistics.median(b):.3f} | {paired:.3f} |")


if __name__ == "__main__":
    main()

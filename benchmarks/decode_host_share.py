r"""How much of a decode step the engine thread spends in Python (issue 13), sampled by the kernel
rather than instrumented.

    .venv/bin/python benchmarks/decode_host_share.py [--batches 1,8,32] [--context 2048] \
        [--steps 200] [--rounds 3] [--threads 2] [--model DIR_OR_PRESET] [--json OUT]

Why not the torch profiler (`step_profile.py`): it records every op, and its own cost is as large
as what it reports: at batch 1 and 2k context a step took 10.87 ms unprofiled and 12.86 ms
profiled, 13.1% of it outside torch ops (docs/benchmarks.md, issue 13, twelfth session).

Method. The model is `step_profile.py`'s (the shape `serving_vs_vllm.py` serves; seeded random
weights, fp32) unless `--model` names another. For each batch size B: B fresh prompts of
`--context` tokens are prefilled, a few decode steps warm up, then `--steps` decode steps run
unobserved (the step's wall time) and `--steps` more with `perf record -e cpu-clock -t TID`
attached to the engine thread: the kernel samples where that thread's instruction pointer is,
`--freq` times a second of its CPU time, and nothing runs inside the process. `--rounds` such
pairs; medians are printed. Each sample is counted by the shared object it falls in:

- python: the interpreter (libpython, the python executable): the Python overhead proper;
- bindings: libtorch_python (pybind11 and argument parsing between Python and torch's C++):
  the price of calling an op from Python, reported beside it;
- ops: torch's kernels and dispatcher (libtorch_cpu with MKL, libc10), OpenMP, oneDNN / MKL
  libraries, the GEMM kernels they generate at run time (perf's `[JIT]`; CPython 3.11 has no
  JIT) and kvcake's own ops;
- other: libc (malloc), the kernel, the loader and anything else.

The engine thread is on a CPU for a whole step (it runs its share of every parallel region and
spins at the barrier), so a share of its samples is a share of the step's wall time; `on_cpu`
(samples / (window x freq)) checks it. Needs Linux perf (Debian `linux-perf`) with software
events allowed (`perf_event_paranoid` <= 2, or root).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.loader import dummy_weights, save_hf_dir
from kvcake.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import PEER_SHAPE, _prompt  # noqa: E402

CLASSES = ("python", "bindings", "ops", "other")
_OPS_PREFIXES = ("libtorch_cpu", "libtorch.so", "libc10", "libgomp", "libiomp", "libmkl",
                 "libdnnl", "kvcake_ops")
_ROW = re.compile(r"^\s*([\d.]+)%\s+(\d+)\s+(\S.*?)\s*$")
WARM_STEPS = 8


def classify(dso: str) -> str:
    """Which of CLASSES a sample in the shared object `dso` (as perf names it) counts for."""
    name = os.path.basename(dso.strip())
    if name.startswith("libpython") or re.fullmatch(r"python3?(\.\d+)?", name):
        return "python"
    if name.startswith("libtorch_python"):
        return "bindings"
    if name.startswith(_OPS_PREFIXES) or dso.startswith("[JIT]"):
        return "ops"  # [JIT]: code generated at run time: oneDNN's and MKL's GEMM kernels
    return "other"


def parse_report(text: str) -> dict[str, int]:
    """Samples per shared object from `perf report --stdio --sort dso -n -q` output."""
    samples: dict[str, int] = {}
    for line in text.splitlines():
        match = _ROW.match(line)
        if match:
            dso = match.group(3)
            samples[dso] = samples.get(dso, 0) + int(match.group(2))
    return samples


def shares(samples: dict[str, int]) -> dict[str, float]:
    """Each class's share of all samples (0 for each when there are none)."""
    total = sum(samples.values())
    out = dict.fromkeys(CLASSES, 0.0)
    for dso, count in samples.items():  # no samples: no iteration, every share 0
        out[classify(dso)] += count / total
    return out


def _steps(engine: Engine, count: int) -> float:
    """Run `count` decode steps; their wall seconds."""
    t0 = time.perf_counter()
    for _ in range(count):
        engine.step()
    return time.perf_counter() - t0


def _sampled_steps(engine: Engine, count: int, freq: int, out: Path) -> tuple[float, str]:
    """`count` decode steps with perf sampling this thread: (wall seconds, perf's report)."""
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(freq),
                             "-t", str(threading.get_native_id()), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # perf attaches; this thread sleeps, so no sample falls here
        if perf.poll() is not None:
            raise RuntimeError(f"perf record exited at once: {perf.stderr.read().decode()}"
                               if perf.stderr else "perf record exited at once")
        wall = _steps(engine, count)
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
    report = subprocess.run(["perf", "report", "-i", str(out), "--stdio", "--sort", "dso", "-n",
                             "-q"], capture_output=True, text=True, check=True).stdout
    return wall, report


def measure(engine: Engine, batch: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    need = WARM_STEPS + 2 * args.steps * args.rounds + 1
    params = SamplingParams(max_tokens=need, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, _prompt(args.context, 1000 * batch + i, vocab), params)
    started: set[str] = set()
    while len(started) < batch:  # the prefills (not measured): each ends with a first token
        started.update(o.request_id for o in engine.step())
    _steps(engine, WARM_STEPS)
    rounds = []
    for rnd in range(args.rounds):
        plain = _steps(engine, args.steps)
        sampled, report = _sampled_steps(engine, args.steps, args.freq, tmp / f"b{batch}-{rnd}")
        counts = parse_report(report)
        total = sum(counts.values())
        rounds.append({"step_ms": 1e3 * plain / args.steps,
                       "step_ms_sampled": 1e3 * sampled / args.steps,
                       "samples": total, "on_cpu": total / (sampled * args.freq),
                       **shares(counts), "dso_samples": counts})
    for rid in ids:
        engine.abort(rid)
    keys = ["step_ms", "step_ms_sampled", "on_cpu", *CLASSES]
    return {"batch": batch, "context": args.context, "rounds": rounds,
            **{k: statistics.median(r[k] for r in rounds) for k in keys}}


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,8,32")
    return values


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=_ints, default=[1, 8, 32],
                   help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=200, help="decode steps per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--freq", type=int, default=2999, help="perf samples per CPU second")
    p.add_argument("--model", help="preset or HF directory (default: the peer shape)")
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    args = p.parse_args(None if argv is None else list(argv))
    for name in ("context", "steps", "rounds", "threads", "freq"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if shutil.which("perf") is None:
        p.error("perf is not installed: apt-get install linux-perf (Debian)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            save_hf_dir(PEER_SHAPE, dummy_weights(PEER_SHAPE, 0), Path(tmp))
            model = tmp
        longest = args.context + WARM_STEPS + 2 * args.steps * args.rounds + 1
        blocks = max(args.batches) * -(-longest // 16) + 16  # the largest batch's, whole
        engine = Engine(model, EngineConfig(dtype="float32", device="cpu", num_blocks=blocks,
                                            max_num_batched_tokens=max(2048, args.context)))
        if longest > engine.max_model_len:
            p.error(f"--context {args.context} + the decode steps ({longest} tokens) exceed the "
                    f"model's {engine.max_model_len}; lower --context or --steps")
        results = [measure(engine, b, args, Path(tmp)) for b in args.batches]
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_avg": os.getloadavg()[0], "threads": args.threads, "results": results}
    print(f"{out['date']}, load avg {out['load_avg']:.2f}, {args.threads} threads, "
          f"{args.context}-token context, {args.steps} steps x {args.rounds} rounds (medians)")
    print("| batch | step ms | step ms, sampled | on CPU | python | bindings | python + bindings "
          "| ops | other |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['step_ms']:.2f} | {r['step_ms_sampled']:.2f} | "
              f"{r['on_cpu']:.2f} | {100 * r['python']:.1f}% | {100 * r['bindings']:.1f}% | "
              f"{100 * (r['python'] + r['bindings']):.1f}% | {100 * r['ops']:.1f}% | "
              f"{100 * r['other']:.1f}% |")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

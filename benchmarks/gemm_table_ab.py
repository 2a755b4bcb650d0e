r"""Does the GEMM tuning table a worker got change its decode step? CPU time of one 1-thread
engine's decode step under each of several tables, interleaved (issue 11 part 3).

    .venv/bin/python benchmarks/gemm_table_ab.py --table A=PATH --table B=PATH \
        [--log-tables run/disagg.log] [--batches 5,2] [--rounds 12] [--json]

`kvcake/engine/linear.py`'s `tune` measures each weight shape's backend per row bucket at a
worker's start-up when the cache's `linear-*-t1.json` lacks it, and writes what it measured; two
workers starting together (prefill and decode) measure on a shared, busy machine and can pick
different backends, so two invocations can serve with different tables (benchmarks/
replay_env.py records which). This swaps the engine's kernels between the tables (`tune` with
each as its `table`) and times decode steps by the process's CPU time, table after table, round
after round, at each batch size (prompts of 1,200-1,800 tokens as in decode_step_cpu.py), so a
loaded machine disturbs every table alike; the per-table median and minimum are printed with
their ratio to the first table. `--log-tables LOG` also takes the tables the workers of a
server log used (its "linear backends" lines), named LOG:1, LOG:2, ...
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

BACKENDS_LINE = re.compile(r"linear backends \(rows [^)]*\) (\{.*\})\s*$")


def tables_from_log(text: str) -> list[dict[str, list[str]]]:
    """Each "linear backends" line of a worker log as a table: shape -> backend per bucket."""
    out = []
    for line in text.splitlines():
        m = BACKENDS_LINE.search(line)
        if m:
            raw = ast.literal_eval(m.group(1))
            out.append({shape: str(v).split("|") for shape, v in raw.items()})
    return out


def table_arg(text: str) -> tuple[str, Path]:
    """`--table NAME=PATH` (argparse type; its error names the option)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--table takes NAME=PATH, got {text!r}")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"--table {name}: {path} is not a file")
    return name, Path(path)


def time_tables(model: str, tables: dict[str, dict[str, list[str]]], batches: list[int],
                rounds: int, steps: int) -> list[dict[str, Any]]:
    """Per batch size (largest first) and table: the decode step's CPU time p50 / min over
    `rounds` rounds of `steps` steps, the tables swapped in turn within each round."""
    import tempfile

    import torch

    from kvcake.engine.config import EngineConfig
    from kvcake.engine.engine import Engine
    from kvcake.engine.linear import Linear, tune
    from kvcake.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    engine = Engine(model, EngineConfig(dtype="float32", device="cpu",
                                        max_num_batched_tokens=2048, kv_cache_bytes=1 << 30))
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    scratch = Path(tempfile.mkdtemp(prefix="kvcake-tables-"))
    paths = {}
    for name, t in tables.items():
        paths[name] = scratch / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json"
        paths[name].write_text(json.dumps(t))
    gen = torch.Generator().manual_seed(0)
    for i in range(batches[0]):
        prompt = torch.randint(4, engine.model_config.vocab_size, (1200 + (i * 37) % 600,),
                               generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20_000, ignore_eos=True))
    running = {f"r{i}" for i in range(batches[0])}
    seen: set[str] = set()
    while len(seen) < len(running):
        seen.update(out.request_id for out in engine.step())
    rows: list[dict[str, Any]] = []
    for batch in batches:
        while len(running) > batch:
            rid = max(running)
            engine.abort(rid)
            running.discard(rid)
        cpu: dict[str, list[float]] = {n: [] for n in tables}
        for _ in range(rounds):
            for name in tables:
                tune(linears, table=paths[name])
                engine.step()  # the first step after a swap warms the new kernels
                for _ in range(steps):
                    t0 = time.process_time()
                    engine.step()
                    cpu[name].append(time.process_time() - t0)
        base = sorted(cpu[next(iter(tables))])[len(cpu[next(iter(tables))]) // 2]
        for name, xs in cpu.items():
            med = sorted(xs)[len(xs) // 2]
            rows.append({"batch": batch, "table": name, "step_cpu_ms_p50": round(1e3 * med, 3),
                         "step_cpu_ms_min": round(1e3 * min(xs), 3),
                         "p50_over_first": round(med / base, 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/kvcake-vs-vllm-model")
    p.add_argument("--table", type=table_arg, action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--log-tables", type=Path, action="append", default=[], metavar="LOG")
    p.add_argument("--batches", default="5,2")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="decode steps per table per round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    tables: dict[str, dict[str, list[str]]] = {
        name: json.loads(path.read_text()) for name, path in args.table}
    for log in args.log_tables:
        for i, t in enumerate(tables_from_log(log.read_text()), 1):
            tables[f"{log.parent.parent.name}:{i}"] = t
    if len(tables) < 2:
        p.error("give at least two tables (--table NAME=PATH, --log-tables LOG)")
    batches = sorted((int(b) for b in args.batches.split(",")), reverse=True)
    rows = time_tables(args.model, tables, batches, args.rounds, args.steps)
    for name, t in tables.items():
        print(f"{name}: {json.dumps({k: '|'.join(v) for k, v in sorted(t.items())})}")
    report = {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "load_avg": list(os.getloadavg()), "rows": rows}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"load {report['load_avg'][0]:.2f} at {report['utc']} UTC")
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""What serving adds to the engine in `kvcake serve --mode single`: served against alone, per token.

    .venv/bin/python benchmarks/serving_threads.py                       # default serve flags
    .venv/bin/python benchmarks/serving_threads.py --serve-args "--switch-interval-ms 0.5"
    .venv/bin/python benchmarks/serving_threads.py --serve-args=--engine-process --no-alone

The model directory is `serving_vs_vllm.py`'s (run that once first). Two parts, the same prompts
(`--trials` fresh random `--prompt-len` prompts, `--max-tokens` out, one at a time, cold: the
`serving_vs_vllm.py` probe):

1. served: `kvcake serve --mode single` (2 torch threads, fp32, plus `--serve-args`) with
   `$KVCAKE_STEP_TRACE`, the prompts streamed by the harness's client. Per thread of the server
   process, its CPU and its runqueue wait (`/proc/PID/task/TID/schedstat`) over the trials, per
   generated token; from the engine loop's step trace, per decode token: the step's wall and the
   engine thread's CPU in it, the hand-off of its tokens (`post`) and the loop's time until the
   next step (`gap`: this is where the engine thread waits for the interpreter lock while the HTTP
   thread streams the last token, as the trace's write releases the lock); the client's TTFT and
   mean TBT.
2. alone: the same engine in one thread bound as the server binds it, no HTTP: prefill wall and
   each decode step's wall and CPU.

Served minus alone is what the HTTP thread, the interpreter lock and the client cost the engine;
on a machine others load, the runqueue waits say how much of it was theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvcake.bench.replay import PlannedRequest, ReplayConfig, replay


def thread_times(pid: int) -> dict[str, tuple[int, int]]:
    """Per thread of `pid` ("tid:main" for its main thread, the HTTP server's; else "tid:name"):
    (ns on a CPU, ns waiting on a runqueue)."""
    out: dict[str, tuple[int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            run_ns, wait_ns = (int(x) for x in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out[f"{task.name}:{'main' if task.name == str(pid) else name}"] = (run_ns, wait_ns)
    return out


def tree_times(pid: int) -> dict[str, tuple[int, int]]:
    """`thread_times` of `pid` and of its child processes (`--engine-process`'s engine; its
    threads named "tid:child:name")."""
    out = thread_times(pid)
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rsplit(")", 1)[1].split()[
                    1] == str(pid):
                out.update({f"{k.split(':')[0]}:child:{k.split(':', 1)[1]}": v
                            for k, v in thread_times(int(entry.name)).items()})
        except (OSError, IndexError):
            continue
    return out


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(4, 31000) for _ in range(args.prompt_len)]
            for _ in range(args.trials + 1)]  # the first one warms up


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 3),
            "p90": round(ordered[math.ceil(0.9 * (len(ordered) - 1))], 3),
            "mean": round(statistics.fmean(ordered), 3)}


def decode_steps(trace: Path, context_from: int) -> dict[str, dict[str, float]]:
    """Per decode token of a single request at `context_from` (its prompt length) or more
    tokens: the step's wall and CPU, its tokens' hand-off and the loop's gap to the next step;
    the wall of each step that prefilled such a prompt; in ms."""
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    rows: dict[str, list[float]] = {"step_wall": [], "step_cpu": [], "post": [], "gap": [],
                                    "token": []}
    for a, b in zip(lines, lines[1:], strict=False):
        if len(a["rows"]) != 1 or a["rows"][0][1] < context_from or b["rows"][:1] != [
                [a["rows"][0][0], a["rows"][0][1] + 1]]:
            continue  # not two consecutive decode steps of one request
        rows["step_wall"].append(1000 * (a["t1"] - a["t0"]))
        rows["step_cpu"].append(1000 * a["cpu"])
        rows["post"].append(1000 * (a["t2"] - a["t1"]))
        rows["gap"].append(1000 * (b["t0"] - a["t2"]))
        rows["token"].append(1000 * (b["t0"] - a["t0"]))
    if not rows["token"]:
        raise RuntimeError(f"{trace}: no decode steps found")
    # the step that prefilled a request (its whole prompt, in one step) is the one before its
    # first decode step; the first such request warmed up
    rows["prefill_step_wall"] = [1000 * (a["t1"] - a["t0"]) for a, b in zip(lines, lines[1:],
                                                                          strict=False)
                                 if len(b["rows"]) == 1 and b["rows"][0][1] == context_from + 1
                                 ][1:]
    return {k: quantiles(v) for k, v in rows.items() if v}


def served(args: argparse.Namespace, work: list[list[int]]) -> dict[str, Any]:
    trace_dir = Path(tempfile.mkdtemp(prefix="kvcake-serving-threads-"))
    env = {**os.environ, "KVCAKE_STEP_TRACE": str(trace_dir)}
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "kvcake", "serve", "--host", "127.0.0.1", "--mode", "single",
           "--model", str(args.model_dir), "--port", str(args.port), "--dtype", "float32",
           "--num-threads", str(args.threads), "--max-model-len", "32768",
           *shlex.split(args.serve_args)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {' '.join(cmd)}")
            time.sleep(0.2)  # polling a child's start-up, no event to wait on
        model = str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])

        def send(prompt: list[int]) -> Any:
            planned = [PlannedRequest(0.0, prompt, args.max_tokens)]
            return asyncio.run(replay(planned, ReplayConfig(url, model)))[0][0]

        send(work[0])
        before = tree_times(proc.pid)
        results = [send(prompt) for prompt in work[1:]]
        after = tree_times(proc.pid)
    finally:
        proc.terminate()
        proc.wait()
    tokens = args.trials * args.max_tokens
    threads = {k: {"cpu_ms_per_token": round((after[k][0] - before.get(k, (0, 0))[0]) / 1e6
                                             / tokens, 3),
                   "runqueue_ms_per_token": round((after[k][1] - before.get(k, (0, 0))[1])
                                                  / 1e6 / tokens, 3)}
               for k in after if after[k][0] - before.get(k, (0, 0))[0] > 10e6}
    [trace] = trace_dir.glob("steps-single-*.jsonl")
    return {"ttft_ms": quantiles([1000 * r.ttft_s for r in results]),
            "mean_tbt_ms": quantiles([1000 * statistics.fmean(r.gaps_s) for r in results]),
            "decode_per_token_ms": decode_steps(trace, args.prompt_len),
            "threads": threads}


def alone(args: argparse.Namespace, work: list[list[int]]) -> dict[str, Any]:
    import torch

    from kvcake.engine.config import EngineConfig
    from kvcake.engine.engine import Engine
    from kvcake.engine.sampling import SamplingParams
    from kvcake.server.frontend.local_backend import bind_engine_threads

    engine = Engine(str(args.model_dir), EngineConfig(dtype="float32", max_model_len=32768))
    out: dict[str, list[float]] = {"prefill_wall": [], "step_wall": [], "step_cpu": []}

    def loop() -> None:  # as the server's engine thread: its own torch pool, bound
        torch.set_num_threads(args.threads)
        bind_engine_threads(args.threads)
        for i, prompt in enumerate(work):
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                    min_tokens=args.max_tokens)
            engine.add_request(f"r{i}", prompt, params)
            first = True
            while engine.has_unfinished():
                t0, c0 = time.perf_counter(), time.thread_time()
                engine.step()
                wall, cpu = 1000 * (time.perf_counter() - t0), 1000 * (time.thread_time() - c0)
                if i == 0:
                    continue  # the warm-up
                if first:
                    out["prefill_wall"].append(wall)
                else:
                    out["step_wall"].append(wall)
                    out["step_cpu"].append(cpu)
                first = False

    thread = threading.Thread(target=loop, name="kvcake-engine")
    thread.start()
    thread.join()
    return {k: quantiles(v) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/kvcake-vs-vllm-model"),
                   help="serving_vs_vllm.py's model directory (run that script once first)")
    p.add_argument("--serve-args", default="", help="more `kvcake serve` flags, one string")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--port", type=int, default=23960)
    p.add_argument("--no-alone", action="store_true", help="the served part only")
    args = p.parse_args()
    if not (args.model_dir / "config.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no config.json; run "
                f"benchmarks/serving_vs_vllm.py once (it writes the model) or pass --model-dir")
    work = prompts(args)
    result: dict[str, Any] = {"serve_args": args.serve_args,
                              "load_before": os.getloadavg()[0], "served": served(args, work)}
    if not args.no_alone:
        result["alone"] = alone(args, work)
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""Why is a prefill after an idle spell slower than back to back? The engine alone, no HTTP.

    .venv/bin/python benchmarks/idle_prefill.py --idle-s 3 --trials 5         # after 3 s idle
    .venv/bin/python benchmarks/idle_prefill.py --idle-s 0 --trials 5         # back to back
    KVCAKE_OMP_SPIN=0 .venv/bin/python benchmarks/idle_prefill.py ...         # a candidate's env

As `kvcake serve --mode single` runs it: one engine thread owns the engine (`--num-threads`
torch threads set on it), the main thread waits on a queue between requests. Per trial a fresh
random `--prompt-len` prompt, 1 token out (the prefill step alone), after `--idle-s` seconds of
idle (the engine thread blocked on its queue, as the server's on its inbox). For each step:
wall time, the process's minor page faults and context switches (getrusage of the process),
and per thread of the process (/proc/self/task): CPU time, migrations between CPUs
(`se.nr_migrations` in /proc/<tid>/sched), voluntary / involuntary switches, the CPU it last
ran on. Medians over trials; the first trial (the warm-up) is shown and left out.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def thread_stats() -> dict[int, dict[str, float]]:
    """Per thread of this process: cpu_ms, migrations, vol / invol switches, last CPU, name."""
    out: dict[int, dict[str, float]] = {}
    for tid_s in os.listdir("/proc/self/task"):
        tid = int(tid_s)
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            sched = Path(f"/proc/self/task/{tid}/sched").read_text()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        row = {"cpu_ms": (int(fields[11]) + int(fields[12])) * 1000.0 / TICK,
               "last_cpu": float(fields[36])}
        for line in sched.splitlines():
            if line.startswith("se.nr_migrations"):
                row["migrations"] = float(line.split(":")[1])
            elif line.startswith("se.sum_exec_runtime"):
                row["exec_ms"] = float(line.split(":")[1])
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                row["vol"] = float(line.split(":")[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                row["invol"] = float(line.split(":")[1])
        out[tid] = row
    return out


def delta(after: dict[int, dict[str, float]], before: dict[int, dict[str, float]],
          names: dict[int, str]) -> dict[str, dict[str, float]]:
    rows = {}
    for tid, a in after.items():
        b = before.get(tid, {k: 0.0 for k in a})
        d = {k: a[k] - b.get(k, 0.0) for k in ("exec_ms", "migrations", "vol", "invol")}
        if d["exec_ms"] < 0.5:
            continue
        d["last_cpu"] = a["last_cpu"]
        rows[names.get(tid, str(tid))] = d
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/kvcake-vs-vllm-model",
                   help="preset or HF directory (serving_vs_vllm.py writes this one)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--vary-len", type=int, default=0,
                   help="trial i's prompt is --prompt-len - i * this (a new shape each trial, as "
                        "the trace's requests; 0: every trial the same length)")
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--bind-threads", action="store_true",
                   help="bind the engine's torch threads as `serve --bind-threads`")
    p.add_argument("--float-engine-thread", action="store_true",
                   help="with --bind-threads: bind only torch's worker threads "
                        "(`serve --no-bind-engine-thread`)")
    p.add_argument("--idle-poll", action="store_true",
                   help="the engine thread polls its queue while idle (sched_yield, as vLLM's "
                        "worker polls its message queue) instead of blocking on it")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import torch

    from kvcake.engine.config import EngineConfig
    from kvcake.engine.engine import Engine
    from kvcake.engine.sampling import SamplingParams

    engine = Engine(args.model, EngineConfig(dtype="float32"))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    jobs: queue.Queue[int | None] = queue.Queue()
    done: queue.Queue[dict[str, object]] = queue.Queue()
    names: dict[int, str] = {}

    def next_job() -> int | None:
        if not args.idle_poll:
            return jobs.get()
        while True:
            try:
                return jobs.get_nowait()
            except queue.Empty:
                os.sched_yield()

    def loop() -> None:
        torch.set_num_threads(args.num_threads)
        names[threading.get_native_id()] = "engine"
        if args.bind_threads:
            from kvcake.server.frontend.local_backend import bind_engine_threads
            bind_engine_threads(args.num_threads, engine_thread=not args.float_engine_thread)
        while (trial := next_job()) is not None:
            length = args.prompt_len - trial * args.vary_len
            prompt = [rng.randrange(4, vocab) for _ in range(length)]
            engine.add_request(f"r{trial}", prompt, SamplingParams(max_tokens=1))
            ru0, th0 = resource.getrusage(resource.RUSAGE_SELF), thread_stats()
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            wall = time.perf_counter() - t0
            ru1, th1 = resource.getrusage(resource.RUSAGE_SELF), thread_stats()
            done.put({"trial": trial, "wall_ms": wall * 1e3,
                      "minflt": ru1.ru_minflt - ru0.ru_minflt,
                      "majflt": ru1.ru_majflt - ru0.ru_majflt,
                      "sys_ms": (ru1.ru_stime - ru0.ru_stime) * 1e3,
                      "user_ms": (ru1.ru_utime - ru0.ru_utime) * 1e3,
                      "threads": delta(th1, th0, names)})

    names[threading.get_native_id()] = "main"
    thread = threading.Thread(target=loop, name="kvcake-engine", daemon=True)
    thread.start()
    rows = []
    for trial in range(args.trials + 1):
        time.sleep(args.idle_s if trial else 0.5)
        jobs.put(trial)
        rows.append(done.get())
    jobs.put(None)
    thread.join()
    # the other threads (OpenMP workers) get names by elimination
    measured = rows[1:]
    keys = ("wall_ms", "minflt", "sys_ms", "user_ms")
    summary = {k: statistics.median(float(r[k]) for r in measured) for k in keys}  # type: ignore[arg-type]
    if args.json:
        print(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1))
        return 0
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("OMP_", "GOMP_", "KMP_", "MALLOC_", "KVCAKE_")) or k == "LD_PRELOAD"}
    print(f"prompt {args.prompt_len} (-{args.vary_len} a trial), idle {args.idle_s} s, {args.num_threads} threads, "
          f"bind {args.bind_threads}, poll {args.idle_poll}, env {env}, load {os.getloadavg()[0]:.2f}")
    for r in rows:
        threads = "; ".join(
            f"{name}: {d['exec_ms']:.0f} ms cpu{int(d['last_cpu'])} mig {d['migrations']:.0f} "
            f"vol {d['vol']:.0f} inv {d['invol']:.0f}"
            for name, d in sorted(r["threads"].items()))  # type: ignore[union-attr,attr-defined]
        print(f"  trial {r['trial']}{' (warm-up)' if r['trial'] == 0 else ''}: "
              f"{r['wall_ms']:.1f} ms, minflt {r['minflt']}, user {r['user_ms']:.0f} "
              f"sys {r['sys_ms']:.0f} ms | {threads}")
    print("  median: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""`kvcake serve` vs vLLM's CPU build on this machine: the same weights, the same workload.

    bash ../shared/tools/peers/vllm_cpu_setup.sh        # once: /tmp/vllmcpu-venv, tokenizer dir
    .venv/bin/python benchmarks/serving_vs_vllm.py       # defaults: a few minutes on 2 cores
    .venv/bin/python benchmarks/serving_vs_vllm.py --systems kvcake-single,kvcake-disagg,vllm \
        --trace-requests 24 --rate 0.25 --out /tmp/serving_vs_vllm.json
    .venv/bin/python benchmarks/serving_vs_vllm.py --systems vllm:float32,vllm:bfloat16 \
        --trace-requests 1       # which dtype vLLM runs best in here (KIND:DTYPE)
    .venv/bin/python benchmarks/serving_vs_vllm.py --systems kvcake-single,vllm:float32 \
        --json-summary --repeats 4   # A B, B A, A B, B A: medians, spread, order effect

One model directory serves both: the peer setup's config.json and WordLevel tokenizer (vocab
32000) plus seeded random weights that this script writes as `model.safetensors` (vLLM loads
them with `--load-format safetensors`, not dummy weights). The systems run one at a time on
127.0.0.1 (never two at once: 2 cores), each started, waited for on /health, given the same
warm-up, measured, then stopped, and waited for until every process of its session has exited
(vLLM's engine core and worker too; `kvcake/bench/proctree.py`). Before each start the host's
CPU busy share over `--settle-s`, free memory and one core's speed are recorded. With
`--repeats N` the systems run N times in alternating order and every figure is the per-system
median (min-max shown), so whichever system runs second is not systematically favoured:

- `kvcake-single`: `kvcake serve --mode single` (one engine in the frontend process), the fair
  match for one vLLM server; `--kvcake-threads` torch threads (2: vLLM's worker gets both cores).
- `kvcake-disagg`: `kvcake serve --config` with 1 prefill + 1 decode worker (one thread each).
- `vllm`: `vllm_cpu_serve.sh start` (the peer launcher: OpenMP bound to cores 0-1, tcmalloc,
  prefix caching, chunked prefill at 2048 tokens).

Every system runs in `--kvcake-dtype` / `--vllm-dtype` unless its entry says `KIND:DTYPE`; ratios
are against the first vLLM entry.

Workload, identical for every system (token-id prompts, `ignore_eos` + `min_tokens` so every
request yields exactly the asked number of tokens; checked):
1. probe: per trial a fresh random `--probe-prompt-len` prompt with `--probe-max-tokens` out, sent
   cold, then the same prompt again (prefix hit); TTFT cold/repeat, mean TBT (gaps of the cold
   request), e2e cold; medians over `--probe-trials`.
2. trace: the first `--trace-requests` records of the conversation trace, lengths scaled by
   `--scale-tokens` (prefix sharing kept, `kvcake/bench/prompts.py`), sent at a fixed `--rate`;
   TTFT and the paper's TBT (mean of a request's slowest 10% of gaps) p50/p90, output tokens/s.
Prefix-cache hit tokens are the delta of each server's `prefix_cache_hits_total` counter.
Printed: one column per system and ours / vLLM ratios (lower is better for times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvcake.bench.hoststate import busy_share, cpu_times, settle, steal_share
from kvcake.bench.proctree import Teardown, session_pids, wait_gone
from kvcake.bench.prompts import PromptBuilder
from kvcake.bench.repeats import alternating_orders, median_result, position_effect, ratios, spread
from kvcake.bench.replay import PlannedRequest, ReplayConfig, plan, replay
from kvcake.bench.stats import Outcome, RequestResult, summarize
from kvcake.engine.config import ModelConfig
from kvcake.sim.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "tools" / "peers"
KINDS = ("kvcake-single", "kvcake-disagg", "vllm")
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class System:
    """One column of the table: `KIND[:DTYPE]` on the command line."""

    kind: str
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.dtype}"


def parse_systems(spec: str, kvcake_dtype: str, vllm_dtype: str) -> list[System]:
    systems = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, dtype = item.partition(":")
        if kind not in KINDS:
            raise ValueError(f"--systems: unknown system {kind!r}; choose from {', '.join(KINDS)}")
        default = vllm_dtype if kind == "vllm" else kvcake_dtype
        systems.append(System(kind, dtype or default))
    if not systems or len({s.label for s in systems}) != len(systems):
        raise ValueError(f"--systems: give each system once, got {spec!r}")
    return systems


@dataclass(frozen=True)
class Server:
    """A started system: how to reach it and how to stop it."""

    system: System
    url: str
    proc: subprocess.Popen[bytes] | None  # None: the peer launcher owns the process
    startup_s: float
    sid: int | None  # the server's session (setsid): every process of it is waited for on stop


def prepare_model(src: Path, dst: Path, seed: int) -> ModelConfig:
    """dst = src's config and tokenizer + seeded random weights (bf16) both systems load."""
    import torch  # here, not at the top: the client side and its tables need no torch
    from safetensors.torch import save_file

    from kvcake.engine.loader import dummy_weights
    if not (src / "config.json").is_file() or not (src / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer-dir: {src} lacks config.json / tokenizer.json; run "
                         f"bash {PEERS / 'vllm_cpu_setup.sh'} first")
    dst.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    config = ModelConfig.from_hf_dict(json.loads((src / "config.json").read_text()), dst.name)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in dummy_weights(config, seed).items()}
    save_file(state, str(dst / "model.safetensors"))
    return config


# --kvcake-bind -> the `kvcake serve --mode single` flags it passes
BIND_FLAGS: dict[str, list[str]] = {
    "default": [], "all": ["--bind-threads", "--bind-engine-thread"],
    "workers": ["--bind-threads", "--no-bind-engine-thread"], "off": ["--no-bind-threads"]}
BIND_CHOICES = tuple(BIND_FLAGS)


def kvcake_command(system: System, args: argparse.Namespace, port: int,
                   run_dir: Path) -> list[str]:
    base = [sys.executable, "-m", "kvcake", "serve", "--host", "127.0.0.1"]
    if system.kind == "kvcake-single":
        return base + ["--mode", "single", "--model", str(args.model_dir), "--port", str(port),
                       "--dtype", system.dtype, "--num-threads", str(args.kvcake_threads),
                       "--max-model-len", str(args.max_model_len)] + BIND_FLAGS[args.kvcake_bind] \
            + shlex.split(args.kvcake_serve_args)
    # --num-threads is not forwarded to launched workers, so the cluster comes from a TOML file
    toml = run_dir / "disagg.toml"
    toml.write_text(
        f'model = "{args.model_dir}"\nmode = "disaggregated"\n'
        f'[frontend]\nhost = "127.0.0.1"\nport = {port}\n'
        f'[store]\nmaster_host = "127.0.0.1"\nmaster_port = {port + 1}\n'
        f'[engine]\ndtype = "{system.dtype}"\nmax_model_len = {args.max_model_len}\n'
        f'[conductor]\nadmission = "none"\n'
        f'[[workers]]\nrole = "prefill"\nport = {port + 2}\nnum_threads = 1\n'
        f'[[workers]]\nrole = "decode"\nport = {port + 3}\nnum_threads = 1\n')
    return base + ["--config", str(toml)]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {log}")


def vllm_env(system: System, args: argparse.Namespace, port: int,
             run_dir: Path) -> dict[str, str]:
    return {**os.environ, "PORT": str(port), "MODEL_DIR": str(args.model_dir),
            "DTYPE": system.dtype, "RUN_DIR": str(run_dir / "vllm"),
            "MAX_MODEL_LEN": str(args.max_model_len), "SERVED_NAME": args.model_dir.name,
            "VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind,
            "START_TIMEOUT": str(round(args.start_timeout_s))}


def start(system: System, args: argparse.Namespace, port: int, run_dir: Path) -> Server:
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    if system.kind == "vllm":  # the launcher waits for /health and exits non-zero on failure
        done = subprocess.run(["bash", str(PEERS / "vllm_cpu_serve.sh"), "start",
                               "--load-format", "safetensors"],
                              env=vllm_env(system, args, port, run_dir), stdout=sys.stderr)
        server = Server(system, url, None, time.monotonic() - started, vllm_sid(run_dir))
        if done.returncode != 0:  # it may still be starting: stop its process group
            stop(server, args, port, run_dir)
            raise RuntimeError(f"vLLM did not start; see {run_dir / 'vllm' / 'server.log'}")
        return server
    log = run_dir / f"{system.kind}.log"
    with log.open("wb") as out:  # own session: stop() signals the whole group (workers too)
        proc = subprocess.Popen(kvcake_command(system, args, port, run_dir), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=ROOT)
    try:
        wait_healthy(url, proc, args.start_timeout_s, log)
    except BaseException:
        stop(Server(system, url, proc, 0.0, proc.pid), args, port, run_dir)
        raise
    return Server(system, url, proc, time.monotonic() - started, proc.pid)


def vllm_sid(run_dir: Path) -> int | None:
    """The launcher starts vLLM with setsid and writes its pid: that pid is the session id."""
    try:
        return int((run_dir / "vllm" / "server.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def stop(server: Server, args: argparse.Namespace, port: int, run_dir: Path) -> Teardown | None:
    """Stop the server and wait until every process of its session has exited: the launcher's
    stop (and our leader's exit) return while vLLM's engine core / kvcake's workers may still be
    tearing down. Returns how long that took after the stop returned (None: no session known)."""
    if server.proc is None:
        subprocess.run(["bash", str(PEERS / "vllm_cpu_serve.sh"), "stop"], check=False,
                       env=vllm_env(server.system, args, port, run_dir), stdout=sys.stderr)
    else:
        try:
            os.killpg(server.proc.pid, signal.SIGTERM)
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
        except ProcessLookupError:
            pass
    if server.sid is None:
        return None
    gone = wait_gone(server.sid, timeout_s=60.0)
    if gone.left_at_start or gone.killed or gone.still_alive:
        print(f"[{server.system.label}] stop returned with {gone.left_at_start} process(es) of "
              f"its session alive; all gone {gone.wait_s:.2f} s later (killed {gone.killed}, "
              f"still alive {gone.still_alive})", file=sys.stderr, flush=True)
    return gone


def prefix_hits(url: str) -> float | None:
    """The server's prefix_cache_hits_total (vllm: or kvcake: prefix), summed over labels."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    found = re.findall(r"^(?:vllm:|kvcake:)prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text,
                       re.MULTILINE)
    return sum(float(v) for v in found) if found else None


def hits_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def send(url: str, model: str, planned: list[PlannedRequest]) -> tuple[list[RequestResult], float]:
    results, duration_s = asyncio.run(replay(planned, ReplayConfig(url, model)))
    for p, r in zip(planned, results, strict=True):
        if r.outcome is not Outcome.OK:
            raise RuntimeError(f"{url}: request failed: {r.error}")
        if r.output_len != p.max_tokens:  # ignore_eos + min_tokens must make lengths exact
            raise RuntimeError(f"{url}: asked {p.max_tokens} tokens, got {r.output_len}")
    return results, duration_s


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(4, vocab_size - 256) for _ in range(length)]


def warm_up(url: str, model: str, vocab_size: int, seed: int) -> None:
    """The same for every system: one prompt per length in sequence, then 4 at once."""
    rng = random.Random(seed + 1_000_003)
    for length in (16, 512, 2048):
        send(url, model, [PlannedRequest(0.0, random_prompt(rng, length, vocab_size), 8)])
    send(url, model, [PlannedRequest(0.0, random_prompt(rng, 256, vocab_size), 8)
                      for _ in range(4)])


def probe(url: str, model: str, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    for _ in range(args.probe_trials):
        prompt = random_prompt(rng, args.probe_prompt_len, vocab_size)
        request = PlannedRequest(0.0, prompt, args.probe_max_tokens)
        h0 = prefix_hits(url)
        [cold], _ = send(url, model, [request])
        h1 = prefix_hits(url)
        [repeat], _ = send(url, model, [request])
        h2 = prefix_hits(url)
        assert cold.ttft_s is not None and repeat.ttft_s is not None and cold.latency_s
        rows.append({"ttft_cold_ms": 1000 * cold.ttft_s, "ttft_repeat_ms": 1000 * repeat.ttft_s,
                     "mean_tbt_ms": 1000 * statistics.fmean(cold.gaps_s),
                     "e2e_cold_ms": 1000 * cold.latency_s, "chunks": 1 + len(cold.gaps_s),
                     "hit_tokens_cold": hits_delta(h0, h1),
                     "hit_tokens_repeat": hits_delta(h1, h2)})
    summary: dict[str, Any] = {k: statistics.median(r[k] for r in rows)
                               for k in ("ttft_cold_ms", "ttft_repeat_ms", "mean_tbt_ms",
                                         "e2e_cold_ms", "chunks")}
    for k in ("hit_tokens_cold", "hit_tokens_repeat"):
        values = [r[k] for r in rows if r[k] is not None]
        summary[k] = statistics.median(values) if values else None
    summary["trials"] = rows
    return summary


SERVER_HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds")


def histogram_sums(url: str) -> dict[str, float]:
    """The server's own per-request histograms (vllm: or kvcake: prefix), `_sum` over labels:
    the delta around one request sent alone is that request's value."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    sums: dict[str, float] = {}
    for name in SERVER_HISTOGRAMS:
        found = re.findall(rf"^(?:vllm:|kvcake:){name}_sum(?:\{{[^}}]*\}})? (\S+)$", text,
                           re.MULTILINE)
        if found:
            sums[name] = sum(float(v) for v in found)
    return sums


def session_run_ns(sid: int | None) -> int | None:
    """CPU time (ns) every thread of the server's session has run so far, from each thread's
    /proc/PID/task/TID/schedstat (ns, unlike stat's 10 ms ticks); None without a session."""
    if sid is None:
        return None
    total = 0
    for pid in session_pids(sid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
    return total


def ttft_sweep(url: str, model: str, args: argparse.Namespace,
               vocab_size: int, sid: int | None = None) -> dict[str, Any]:
    """Diagnostic (`--ttft-sweep`): fresh random prompts of each length sent one at a time to the
    idle server (cold: no prefix to reuse), 2 tokens out. Per length the medians of the client's
    TTFT, the server's own TTFT (arrival to first token) and, where the server exports them, its
    queue and prefill time; the client minus the server TTFT is the HTTP and framing outside.
    `--sweep-idle-s`: the server left idle that long before each prompt, as between the trace's
    requests (threads asleep, caches cold). With the server's session id: the CPU time all its
    processes' threads ran during the request (`server_cpu_ms`) and that over the server's TTFT
    (`server_cores`: about 2 when both compute threads ran side by side, about 1 when they
    shared one core)."""
    rng = random.Random(args.seed + 7)
    out: dict[str, Any] = {}
    for length in args.ttft_sweep:
        rows: list[dict[str, float]] = []
        for _ in range(args.sweep_trials):
            time.sleep(args.sweep_idle_s)  # as in the trace: the server idle before a request
            before = histogram_sums(url)
            cpu_before = session_run_ns(sid)
            [r], _ = send(url, model, [PlannedRequest(0.0, random_prompt(rng, length, vocab_size),
                                                      2)])
            cpu_after = session_run_ns(sid)
            after = histogram_sums(url)
            assert r.ttft_s is not None
            row = {"client_ttft_ms": 1000 * r.ttft_s}
            row.update({f"server_{k.removesuffix('_seconds')}_ms": 1000 * (after[k] - before[k])
                        for k in after if k in before})
            if cpu_before is not None and cpu_after is not None:
                row["server_cpu_ms"] = (cpu_after - cpu_before) / 1e6
                server_ttft = row.get("server_time_to_first_token_ms")
                if server_ttft:  # the request's CPU includes its second token and the HTTP side
                    row["server_cores"] = row["server_cpu_ms"] / server_ttft
            rows.append(row)
        out[str(length)] = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]
                            if all(k in r for r in rows)}
    return out


def trace_workload(args: argparse.Namespace, vocab_size: int) -> list[PlannedRequest] | None:
    if not args.trace.is_file():
        print(f"trace: {args.trace} not found; skipping the trace replay (pass --trace FILE)",
              file=sys.stderr)
        return None
    records = list(load_trace(args.trace).sampled(first=args.trace_requests).requests)
    builder = PromptBuilder(vocab_size=vocab_size, scale_tokens=args.scale_tokens, seed=args.seed)
    planned = plan(records, builder, speed=1.0)
    # A fixed request rate instead of the trace's arrival times; prompts cut to --max-prompt-len
    # (the head is kept, so is the prefix sharing) and to the context.
    room = min(args.max_prompt_len, args.max_model_len - max(p.max_tokens for p in planned))
    return [replace(p, send_at_s=i / args.rate, prompt_token_ids=p.prompt_token_ids[:room])
            for i, p in enumerate(planned)]


def run_trace(url: str, model: str, planned: list[PlannedRequest],
              args: argparse.Namespace) -> dict[str, Any]:
    before = prefix_hits(url)
    results, duration_s = send(url, model, planned)
    report = summarize(results, duration_s, args.ttft_slo_s, args.tbt_slo_ms / 1000.0)
    keys = ("median_ttft_ms", "p90_ttft_ms", "median_tbt_ms", "p90_tbt_ms", "median_itl_ms",
            "output_throughput", "duration", "total_input_tokens", "total_output_tokens",
            "effective_request_capacity")
    out: dict[str, Any] = {k: report[k] for k in keys}
    out["hit_tokens"] = hits_delta(before, prefix_hits(url))
    # per request, for --out: where a TTFT p90 comes from (queueing behind a long prefill?)
    out["requests"] = [{"send_at_s": p.send_at_s, "prompt_len": r.prompt_len,
                        "output_len": r.output_len,
                        "ttft_ms": None if r.ttft_s is None else round(1000 * r.ttft_s, 2),
                        "max_gap_ms": round(1000 * max(r.gaps_s), 2) if r.gaps_s else None}
                       for p, r in zip(planned, results, strict=True)]
    return out


def measure(system: System, args: argparse.Namespace, port: int, run_dir: Path, vocab_size: int,
            planned: list[PlannedRequest] | None) -> dict[str, Any]:
    name = system.label
    host = settle(args.settle_s)  # after the previous system is gone: how quiet is the host now
    print(f"[{name}] host before start: {json.dumps(host.as_dict())}; starting on port {port}",
          file=sys.stderr, flush=True)
    server = start(system, args, port, run_dir)
    result: dict[str, Any] = {"host_before": host.as_dict()}
    try:
        model = str(httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"])
        print(f"[{name}] healthy after {server.startup_s:.1f} s; warm-up", file=sys.stderr,
              flush=True)
        warm_up(server.url, model, vocab_size, args.seed)
        during = cpu_times()
        result.update({"startup_s": server.startup_s,
                       "probe": probe(server.url, model, args, vocab_size)})
        shown = {k: v for k, v in result["probe"].items() if k != "trials"}
        print(f"[{name}] probe: {json.dumps(shown)}", file=sys.stderr, flush=True)
        if args.ttft_sweep:
            result["ttft_sweep"] = ttft_sweep(server.url, model, args, vocab_size, server.sid)
            print(f"[{name}] ttft sweep: {json.dumps(result['ttft_sweep'])}", file=sys.stderr,
                  flush=True)
        if planned is not None:
            result["trace"] = run_trace(server.url, model, planned, args)
            shown = {k: v for k, v in result["trace"].items() if k != "requests"}
            print(f"[{name}] trace: {json.dumps(shown)}", file=sys.stderr, flush=True)
        after = cpu_times()  # the measured part (probe + trace): busy with us, stolen by others
        result["host_during"] = {"cpu_busy": busy_share(during, after),
                                 "steal": steal_share(during, after)}
    finally:
        gone = stop(server, args, port, run_dir)
    result["teardown"] = None if gone is None else gone.as_dict()
    return result


ROWS = (("startup_s", "server start to healthy (s)"),
        ("probe.ttft_cold_ms", "probe TTFT cold (ms)"),
        ("probe.ttft_repeat_ms", "probe TTFT repeat (ms)"),
        ("probe.mean_tbt_ms", "probe mean TBT (ms)"),
        ("probe.e2e_cold_ms", "probe e2e cold (ms)"),
        ("probe.hit_tokens_repeat", "probe hit tokens, repeat"),
        ("trace.median_ttft_ms", "trace TTFT p50 (ms)"),
        ("trace.p90_ttft_ms", "trace TTFT p90 (ms)"),
        ("trace.median_tbt_ms", "trace TBT p50 (ms)"),
        ("trace.p90_tbt_ms", "trace TBT p90 (ms)"),
        ("trace.median_itl_ms", "trace ITL p50 (ms)"),
        ("trace.output_throughput", "trace output tok/s"),
        ("trace.hit_tokens", "trace hit tokens"),
        ("trace.effective_request_capacity", "trace share meeting SLOs"))


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def peer_and_ours(names: list[str]) -> tuple[str | None, list[str]]:
    """The first vLLM column (the base of every ratio) and the other columns."""
    return (next((n for n in names if n.startswith("vllm")), None),
            [n for n in names if not n.startswith("vllm")])


def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Per system the median over its runs (with min-max when there are several) and ours / vLLM
    of the medians."""
    names = list(runs)
    peer, ours = peer_and_ours(names)
    ratio_cols = [f"{n.removeprefix('kvcake-')} / {peer}" for n in ours] if peer else []
    print(f"| metric | {' | '.join(names)} | {' | '.join(ratio_cols)} |".replace(" |  |", " |"))
    print("|---" * (1 + len(names) + len(ratio_cols)) + "|")
    for path, label in ROWS:
        spreads = [spread(runs[n], path) for n in names]
        if all(v is None for v in spreads):
            continue
        cells = ["-" if v is None else fmt(v.median) if v.n == 1 else
                 f"{fmt(v.median)} ({fmt(v.low)}-{fmt(v.high)})" for v in spreads]
        if peer is not None:
            base = spread(runs[peer], path)
            for n in ours:
                v = spread(runs[n], path)
                cells.append("-" if v is None or base is None or not base.median
                             else f"{v.median / base.median:.2f}")
        print(f"| {label} | {' | '.join(cells)} |")


SUMMARY = (("probe_ttft_cold", "probe.ttft_cold_ms"), ("probe_mean_tbt", "probe.mean_tbt_ms"),
           ("trace_ttft_p50", "trace.median_ttft_ms"), ("trace_ttft_p90", "trace.p90_ttft_ms"),
           ("trace_tbt_p50", "trace.median_tbt_ms"), ("trace_tbt_p90", "trace.p90_tbt_ms"))
MEDIAN_PATHS = tuple(path for path, _ in ROWS)


def summary_ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """ours / vLLM per summary metric: the first kvcake and the first vLLM column."""
    peer, ours = peer_and_ours(list(results))
    return ratios(results[ours[0]] if ours else None, results[peer] if peer else None, SUMMARY)


def print_sweep(runs: dict[str, list[dict[str, Any]]]) -> None:
    """`--ttft-sweep`: per length and system the medians over repeats of each sweep figure."""
    names = [n for n in runs if all("ttft_sweep" in r for r in runs[n])]
    if not names:
        return
    print("| prompt len | system | " + " | ".join(("client TTFT", "server TTFT", "server queue",
                                                   "server prefill", "server CPU")) +
          " (ms) | server cores |")
    print("|---" * 8 + "|")
    keys = ("client_ttft_ms", "server_time_to_first_token_ms", "server_request_queue_time_ms",
            "server_request_prefill_time_ms", "server_cpu_ms", "server_cores")
    for length in runs[names[0]][0]["ttft_sweep"]:
        for n in names:
            cells = []
            for k in keys:
                vs = [r["ttft_sweep"][length].get(k) for r in runs[n]]
                vs = [v for v in vs if v is not None]
                cells.append(fmt(statistics.median(vs)) if vs else "-")
            print(f"| {length} | {n} | {' | '.join(cells)} |")


def print_positions(runs: list[dict[str, Any]], labels: list[str]) -> None:
    """Each system's medians when it ran first and when it ran second (alternating orders)."""
    print("| system | metric | ran first | ran second | second / first |")
    print("|---|---|---|---|---|")
    for label in labels:
        for key, path in SUMMARY:
            pos = position_effect(runs, label, path)
            if 0 in pos and 1 in pos:
                change = f"{pos[1] / pos[0]:.2f}" if pos[0] else "-"
                print(f"| {label} | {key} | {fmt(pos[0])} | {fmt(pos[1])} | {change} |")


def print_runs(runs: list[dict[str, Any]]) -> None:
    """One line per repeat: its order, that repeat's summary ratios, each system's host state
    before it started, the CPU busy and steal shares while it was measured (the same work busies
    the host about as much every time: a share well above the system's others is someone else's
    work) and how long its teardown took after the stop returned."""
    keys = [k for k, _ in SUMMARY]
    print(f"| repeat | order | {' | '.join(keys)} | host before each (busy, MiB free, spin ms) "
          f"| while measured (CPU busy, steal) | teardown after stop (s, procs left) |")
    print("|---" * (5 + len(keys)) + "|")
    for run in runs:
        rs = run["ratios"]
        host = "; ".join(f"{n}: {r['host_before']['cpu_busy']}, "
                         f"{r['host_before']['mem_available_mib']:.0f}, "
                         f"{r['host_before']['spin_ms']}" for n, r in run["results"].items())
        steal = "; ".join(f"{n}: {fmt(r.get('host_during', {}).get('cpu_busy'))}, "
                          f"{fmt(r.get('host_during', {}).get('steal'))}"
                          for n, r in run["results"].items())
        down = "; ".join(f"{n}: -" if r.get("teardown") is None else
                         f"{n}: {r['teardown']['wait_s']:.2f}, {r['teardown']['left_at_start']}"
                         for n, r in run["results"].items())
        print(f"| {run['repeat']} | {' > '.join(run['order'])} | "
              f"{' | '.join(fmt(rs[k]) for k in keys)} | {host} | {steal} | {down} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="kvcake-single,vllm",
                   help=f"comma-separated KIND[:DTYPE], run in this order; KIND of "
                        f"{', '.join(KINDS)}")
    p.add_argument("--tokenizer-dir", type=Path, default=Path("/tmp/vllm-tiny-llama"),
                   help="config.json + tokenizer.json from the peer setup script")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/kvcake-vs-vllm-model"),
                   help="written here: that config, tokenizer and seeded weights")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts")
    p.add_argument("--kvcake-dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--kvcake-threads", type=int, default=2,
                   help="torch threads of --mode single (default: as many as vLLM's worker gets "
                        "with bind 0-1; 1 is faster when the cores are busy with other work); "
                        "the disaggregated workers use 1 each")
    p.add_argument("--kvcake-bind", choices=BIND_CHOICES, default="default",
                   help="kvcake-single's thread binding: default (no flag: `kvcake serve`'s "
                        "own default), all (--bind-threads --bind-engine-thread), workers "
                        "(--bind-threads --no-bind-engine-thread: torch's worker threads "
                        "only), off (--no-bind-threads)")
    p.add_argument("--kvcake-bind-threads", action="store_const", const="all", dest="kvcake_bind",
                   help="the same as --kvcake-bind all")
    p.add_argument("--kvcake-serve-args", default="",
                   help="more `kvcake serve --mode single` flags, one string (diagnostics, e.g. "
                   "'--switch-interval-ms 0.5'); with $KVCAKE_STEP_TRACE=DIR the server writes "
                   "its per-step trace there")
    p.add_argument("--vllm-dtype", default="float32",
                   help="fp32: 3-4x faster prefill than bf16 on a CPU without AVX512-BF16/AMX "
                        "(docs/benchmarks.md); the peer launcher's own default is bfloat16")
    p.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--probe-prompt-len", type=int, default=2048)
    p.add_argument("--probe-max-tokens", type=int, default=64)
    p.add_argument("--probe-trials", type=int, default=3)
    p.add_argument("--trace", type=Path,
                   default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")
    p.add_argument("--trace-requests", type=int, default=16)
    p.add_argument("--scale-tokens", type=float, default=1 / 8,
                   help="trace lengths x this; 1/8: a 512-token trace block is 64 tokens (4 of "
                        "our blocks, half of one of vLLM's 128-token CPU blocks)")
    p.add_argument("--max-prompt-len", type=int, default=4096, help="trace prompts cut to this")
    p.add_argument("--rate", type=float, default=0.25, help="trace requests per second")
    p.add_argument("--ttft-slo-s", type=float, default=5.0)
    p.add_argument("--tbt-slo-ms", type=float, default=100.0)
    p.add_argument("--port-base", type=int, default=23000,
                   help="system i uses ports base+10i .. base+10i+3")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/kvcake-vs-vllm-run"))
    p.add_argument("--repeats", type=int, default=1,
                   help="run the systems this many times in alternating order (1: the --systems "
                        "order; 2: A B, B A; 4: A B B A A B B A); every system restarts and gets "
                        "the same warm-up, probe and trace each time; tables and --json-summary "
                        "use per-system medians, and each repeat's ratios are printed too")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="before each system starts, after the previous one's processes have all "
                        "exited: wait this long and record the host's CPU busy share, free memory "
                        "and one core's speed")
    p.add_argument("--ttft-sweep", type=lambda v: [int(x) for x in v.split(",") if x],
                   default=[], metavar="LENS",
                   help="diagnostic, before the trace: cold prompts of these lengths (e.g. "
                        "256,845,2048) sent one at a time, the client's and the server's own "
                        "TTFT (and vLLM's queue / prefill time) per length; printed per system")
    p.add_argument("--sweep-trials", type=int, default=3, help="prompts per --ttft-sweep length")
    p.add_argument("--sweep-idle-s", type=float, default=0.0,
                   help="--ttft-sweep: leave the server idle this long before each prompt (the "
                        "trace at 0.25/s leaves it idle ~3 s between requests)")
    p.add_argument("--out", type=Path, help="write all results as JSON here")
    p.add_argument("--json-summary", action="store_true",
                   help='print one last line {"ratios": {...}}: the first kvcake system / the '
                        'first vLLM system for probe_ttft_cold, probe_mean_tbt, trace_ttft_p50, '
                        'trace_ttft_p90, trace_tbt_p50, trace_tbt_p90 (null when not measured), '
                        'of the per-system medians over --repeats; also "ratios_per_run"')
    args = p.parse_args()
    try:
        args.systems = parse_systems(args.systems, args.kvcake_dtype, args.vllm_dtype)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("probe_prompt_len", "probe_max_tokens", "probe_trials", "trace_requests",
                 "max_prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.rate > 0 and args.scale_tokens > 0):
        p.error("--rate and --scale-tokens must be > 0")
    if args.settle_s < 0:
        p.error(f"--settle-s must be >= 0, got {args.settle_s}")
    if args.probe_prompt_len + args.probe_max_tokens > args.max_model_len:
        p.error("--probe-prompt-len + --probe-max-tokens must fit in --max-model-len")
    args.model_dir = args.model_dir.resolve()
    return args


def exit_on_sigterm(signum: int, frame: object) -> None:
    """`timeout`/`kill` of the benchmark: unwind, so that the running server is stopped too."""
    raise SystemExit(128 + signum)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    config = prepare_model(args.tokenizer_dir, args.model_dir, args.seed)
    planned = trace_workload(args, config.vocab_size)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()
    ports = {s.label: args.port_base + 10 * i for i, s in enumerate(args.systems)}
    by_label = {s.label: s for s in args.systems}
    runs: list[dict[str, Any]] = []
    for repeat, order in enumerate(alternating_orders(list(by_label), args.repeats)):
        print(f"repeat {repeat + 1}/{args.repeats}: {' > '.join(order)}", file=sys.stderr,
              flush=True)
        results = {label: measure(by_label[label], args, ports[label], args.run_dir,
                                  config.vocab_size, planned) for label in order}
        results = {s.label: results[s.label] for s in args.systems}  # columns in --systems order
        runs.append({"repeat": repeat + 1, "order": order, "results": results,
                     "ratios": summary_ratios(results)})
        if args.out is not None and repeat + 1 < args.repeats:  # kept if a later one fails
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "started": started, "partial": True, "runs": runs},
                                           indent=2) + "\n")
    load_after = os.getloadavg()
    per_system = {s.label: [run["results"][s.label] for run in runs] for s in args.systems}
    medians = {label: median_result(rs, MEDIAN_PATHS) for label, rs in per_system.items()}
    print(f"{started}; load average before {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f} "
          f"{load_after[2]:.2f}; kvcake single {args.kvcake_threads} torch thread(s) (bind "
          f"{args.kvcake_bind}), vLLM "
          f"OpenMP bind {args.vllm_bind}; {args.repeats} repeat(s), alternating order")
    if planned is not None:
        num_out = sum(p.max_tokens for p in planned)
        num_in = sum(len(p.prompt_token_ids) for p in planned)
        print(f"trace: {len(planned)} requests at {args.rate:g}/s, {num_in} prompt and "
              f"{num_out} output tokens (scale {args.scale_tokens:g})")
    print_table(per_system)
    if args.ttft_sweep:
        print()
        print_sweep(per_system)
    print()
    print_runs(runs)
    if args.repeats > 1 and len(args.systems) == 2:
        print()
        print_positions(runs, list(by_label))
    summary = {"ratios": summary_ratios(medians), "repeats": args.repeats,
               "ratios_per_run": [run["ratios"] for run in runs]}
    if args.out is not None:
        spreads = {label: {path: found.as_dict() for path in MEDIAN_PATHS
                           if (found := spread(rs, path)) is not None}
                   for label, rs in per_system.items()}
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "started": started, "load_before": load_before,
                                        "load_after": load_after, "runs": runs,
                                        "medians": medians, "spreads": spreads, **summary},
                                       indent=2) + "\n")
    if args.json_summary:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

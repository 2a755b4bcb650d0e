"""Chaos soak: `kvcake serve --prefill 2 --decode 2` under a replayed trace while faults hit it.

    .venv/bin/python benchmarks/soak.py --duration-s 600 --fault-every-s 60 --out soak.json
    .venv/bin/python benchmarks/soak.py --short        # ~1 minute, one fault of each kind

The trace (`--trace`, Mooncake JSONL; prompts built as `kvcake bench` builds them) is replayed
as streaming greedy `/v1/completions` at `--load-share` (0.7) of `--capacity-rps` (the rate
`kvcake bench --find-capacity` found: see docs/benchmarks.md), Poisson arrivals. Every
`--fault-every-s` the next fault, in turn:
  kill_decode       SIGKILL a decode worker
  kill_prefill      SIGKILL a prefill worker
  stop_worker       SIGSTOP a decode worker for --fault-length-s, then SIGCONT
  kill_store_node   SIGKILL the other prefill worker: its store node holds the KV its prefills
                    stored (store puts go to the local node), so live objects die with it
  transport         drop 5% / delay 20% (50 ms) of every transfer slice for --fault-length-s
                    (worker/faults.py through $KVCAKE_FAULTS_FILE)
  client_disconnect for --fault-length-s half the clients close their stream after 2 events
Every request ends as exactly one of: completed (finish reason and [DONE]), rejected (429),
clean_error (an SSE error event, or a 4xx other than 429), client_aborted (we closed it), 5xx,
or lost (no end: a stream cut without an error event, a connection error, or no end within
--request-timeout-s). Every completed output is checked against the offline engine
(`kvcake.LLM`, same model and engine settings, greedy): `wrong` counts the differences.
Capacity back: after each fault, the seconds until `/health` shows every worker live and a
probe request completes again (after a kill: once the killed worker runs as a new process). Target: 0 lost, 0 wrong, 0 5xx, capacity back within 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAULTS = ("kill_decode", "kill_prefill", "stop_worker", "kill_store_node", "transport",
          "client_disconnect")
OUTCOMES = ("completed", "rejected", "clean_error", "client_aborted", "5xx", "lost")
TRANSPORT_FAULTS = {"drop_rate": 0.05, "delay_rate": 0.2, "delay_s": 0.05}


@dataclass
class Tally:
    sent: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    completed: list[tuple[tuple[int, ...], int, list[int]]] = field(default_factory=list)
    lost_examples: list[str] = field(default_factory=list)
    disconnect_until: float = 0.0


def worker_pids(serve_pid: int) -> dict[str, int]:
    """worker id -> pid of the `kvcake worker` children of `serve_pid` (read from /proc)."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "worker" in argv and "--parent-pid" in argv and \
                argv[argv.index("--parent-pid") + 1] == str(serve_pid) and "--worker-id" in argv:
            found[argv[argv.index("--worker-id") + 1]] = int(entry)
    return found


def start_server(args: argparse.Namespace, faults_file: str, log_path: Path
                 ) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "KVCAKE_FAULTS_FILE": faults_file}
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([sys.executable, "-m", "kvcake", "serve", "--model", args.model,
                             "--prefill", str(args.prefill), "--decode", str(args.decode),
                             "--port", "0"], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("kvcake serve: http://"):
                return proc, line.split()[2]
        if proc.poll() is not None:
            raise RuntimeError(f"kvcake serve exited ({proc.returncode}); see {log_path}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("kvcake serve did not start in 600 s")


def prompts(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    from kvcake.bench.prompts import PromptBuilder
    from kvcake.sim.trace import load_trace

    trace = load_trace(args.trace)
    builder = PromptBuilder(vocab_size=512, scale_tokens=args.scale_tokens, seed=args.seed)
    out = []
    for r in trace.requests[: args.max_trace_requests]:
        prompt = builder.build(r.hash_ids, r.input_len, r.index)[: args.max_prompt_tokens]
        out.append((prompt, min(args.max_tokens, builder.scaled_len(r.output_len))))
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                      tally: Tally, timeout_s: float) -> None:
    tally.sent += 1
    disconnect = time.monotonic() < tally.disconnect_until and random.random() < 0.5
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    outcome, tokens, why = "lost", [], ""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + "/v1/completions", json=body) as reply:
                if reply.status_code == 429:
                    outcome = "rejected"
                elif reply.status_code >= 500:
                    outcome, why = "5xx", (await reply.aread())[:200].decode(errors="replace")
                elif reply.status_code != 200:
                    outcome = "clean_error"
                else:
                    finished, done, events = False, False, 0
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            outcome = "clean_error"
                            break
                        choice = event["choices"][0]
                        tokens += choice.get("token_ids") or []
                        finished = finished or choice.get("finish_reason") is not None
                        events += 1
                        if disconnect and events >= 2:
                            outcome = "client_aborted"
                            break
                    if done and finished:
                        outcome = "completed"
                    elif outcome == "lost":
                        why = f"stream ended without an end or an error ({events} events)"
    except TimeoutError:
        why = f"no end within {timeout_s} s"
    except httpx.HTTPError as exc:
        why = f"{type(exc).__name__}: {exc}"
    tally.outcomes[outcome] += 1
    if outcome == "completed":
        tally.completed.append((tuple(prompt), max_tokens, tokens))
    elif outcome in ("lost", "5xx") and len(tally.lost_examples) < 20:
        tally.lost_examples.append(f"{outcome}: {why}")


async def capacity_back(client: httpx.AsyncClient, url: str, num_workers: int,
                        since: float, limit_s: float, serve_pid: int,
                        replaced: tuple[str, int] | None) -> float | None:
    """Seconds from `since` until every worker is live and a probe request completes; after a
    kill, only once the killed worker `replaced` = (id, old pid) runs as a new process (before
    that the frontend may not have noticed the loss yet)."""
    while time.monotonic() - since < limit_s:
        if replaced is not None and worker_pids(serve_pid).get(replaced[0]) in (None,
                                                                               replaced[1]):
            await asyncio.sleep(0.25)
            continue
        try:
            health = (await client.get(url + "/health", timeout=5)).json()
            if health.get("workers") == num_workers:
                reply = await client.post(url + "/v1/completions", timeout=30, json={
                    "model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2,
                    "ignore_eos": True})
                if reply.status_code == 200:
                    return round(time.monotonic() - since, 2)
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return None


async def inject(kind: str, serve_pid: int, faults_file: str, length_s: float,
                 tally: Tally) -> dict[str, Any]:
    pids = worker_pids(serve_pid)
    record: dict[str, Any] = {"kind": kind}
    target = {"kill_decode": "decode-2", "kill_prefill": "prefill-0", "stop_worker": "decode-3",
              "kill_store_node": "prefill-1"}.get(kind)
    if target is not None:
        target = target if target in pids else sorted(pids)[0]
        record.update(target=target, pid=pids[target])
    if kind in ("kill_decode", "kill_prefill", "kill_store_node"):
        os.kill(pids[target], signal.SIGKILL)
    elif kind == "stop_worker":
        os.kill(pids[target], signal.SIGSTOP)
        await asyncio.sleep(length_s)
        try:
            os.kill(pids[target], signal.SIGCONT)
        except ProcessLookupError:  # declared lost and replaced meanwhile
            record["replaced_while_stopped"] = True
    elif kind == "transport":
        Path(faults_file).write_text(json.dumps(TRANSPORT_FAULTS))
        await asyncio.sleep(length_s)
        os.unlink(faults_file)
    elif kind == "client_disconnect":
        tally.disconnect_until = time.monotonic() + length_s
    return record


async def run(args: argparse.Namespace, url: str, serve_pid: int, faults_file: str
              ) -> tuple[Tally, list[dict[str, Any]]]:
    work = prompts(args)
    rate = args.capacity_rps * args.load_share
    rng = random.Random(args.seed)
    tally, faults = Tally(), []
    num_workers = args.prefill + args.decode
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        start = time.monotonic()
        tasks: set[asyncio.Task[None]] = set()

        async def fault_loop() -> None:
            k = 0
            while True:
                k += 1
                at = start + k * args.fault_every_s
                if at >= start + args.duration_s:
                    return
                await asyncio.sleep(at - time.monotonic())
                kind = FAULTS[(k - 1) % len(FAULTS)]
                t0 = time.monotonic()
                record = await inject(kind, serve_pid, faults_file, args.fault_length_s, tally)
                record["t_s"] = round(t0 - start, 1)
                killed = (record["target"], record["pid"]) if kind.startswith("kill") else None
                record["capacity_back_s"] = await capacity_back(
                    client, url, num_workers, t0, args.fault_every_s - 1, serve_pid, killed)
                faults.append(record)
                print(f"[soak] t={record['t_s']}s {kind} {record.get('target', '')}: capacity "
                      f"back after {record['capacity_back_s']} s", file=sys.stderr, flush=True)

        fault_task = asyncio.create_task(fault_loop())
        i = 0
        while time.monotonic() - start < args.duration_s:
            prompt, max_tokens = work[i % len(work)]
            i += 1
            task = asyncio.create_task(one_request(client, url, prompt, max_tokens, tally,
                                                   args.request_timeout_s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await fault_task
        if tasks:
            await asyncio.wait(tasks)
    return tally, faults


def check_wrong(args: argparse.Namespace, tally: Tally) -> int:
    from kvcake import LLM, SamplingParams

    llm = LLM(args.model)
    distinct = sorted({(p, n) for p, n, _ in tally.completed})
    expected: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for n in sorted({n for _, n in distinct}):
        group = [p for p, m in distinct if m == n]
        outs = llm.generate([list(p) for p in group], SamplingParams(max_tokens=n,
                                                                      ignore_eos=True))
        expected.update({(p, n): o.token_ids for p, o in zip(group, outs, strict=True)})
    return sum(1 for p, n, got in tally.completed if expected[(p, n)] != got)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--fault-every-s", type=float, default=60.0)
    p.add_argument("--fault-length-s", type=float, default=15.0)
    p.add_argument("--capacity-rps", type=float, default=9.25,
                   help="the rate kvcake bench --find-capacity found (docs/benchmarks.md)")
    p.add_argument("--load-share", type=float, default=0.7)
    p.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" /
                                          "conversation_trace.jsonl"))
    p.add_argument("--scale-tokens", type=float, default=0.03125)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=1500)
    p.add_argument("--max-trace-requests", type=int, default=2000)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--short", action="store_true",
                   help="~1 minute: a fault every 9 s (one of each kind), 5 s long, 2 req/s")
    p.add_argument("--out", default=None, help="write the JSON report here too")
    p.add_argument("--keep-log", default=None, help="copy kvcake serve's log here")
    args = p.parse_args(argv)
    if args.short:
        args.duration_s, args.fault_every_s, args.fault_length_s = 60.0, 9.0, 5.0
        args.capacity_rps, args.load_share = 2.0, 1.0
    if not Path(args.trace).is_file():
        print(f"soak: trace {args.trace} not found (--trace)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvcake-soak-") as tmp:
        faults_file = os.path.join(tmp, "faults.json")
        log_path = Path(tmp) / "serve.log"
        load_before = os.getloadavg()
        server, url = start_server(args, faults_file, log_path)
        try:
            began = time.time()
            tally, faults = asyncio.run(run(args, url, server.pid, faults_file))
            alive = httpx.get(url + "/health", timeout=10).status_code == 200
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
            serve_log = log_path.read_text(errors="replace").splitlines()
            if args.keep_log:
                Path(args.keep_log).write_text("\n".join(serve_log) + "\n")
    wrong = check_wrong(args, tally)
    backs = [f["capacity_back_s"] for f in faults]
    report = {
        "command": " ".join(["benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(began)),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "rate_rps": round(args.capacity_rps * args.load_share, 2),
        "duration_s": args.duration_s, "sent": tally.sent, **tally.outcomes, "wrong": wrong,
        "faults": faults, "server_alive_after": alive, "lost_examples": tally.lost_examples,
        "target_met": {"lost": tally.outcomes["lost"] == 0, "wrong": wrong == 0,
                       "5xx": tally.outcomes["5xx"] == 0,
                       "capacity_back_30s": all(b is not None and b <= 30 for b in backs)},
        "serve_log_warnings": [line for line in serve_log if " WARNING " in line
                               or " ERROR " in line][-40:],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The servers the serving benchmarks start, one at a time on 127.0.0.1, and stop: a system
(`KIND[:DTYPE]`: kvcake `--mode single`, kvcake 1P+1D, or vLLM's CPU build through
../shared/tools/peers), the model directory both load (`prepare_model`), the start (until
/health answers) and the stop (until every process of the server's session is gone), and the
CPU its session ran (`session_run_ns`). Used by serving_vs_vllm.py and the capacity benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvcake.bench.proctree import Teardown, session_pids, wait_gone
from kvcake.engine.config import ModelConfig

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

"""`kvcake worker` (one prefill, decode or colocated worker) and `kvcake profile`.

    kvcake worker --role prefill --port 24100 --master 10.0.0.1:24000
    kvcake profile --model tiny --num-threads 1

A worker prints `kvcake worker ready <worker_id> <HOST:PORT>` on stdout once it serves, then runs
until SIGINT/SIGTERM (or until its `--parent-pid` is gone, so a launcher's children never
outlive it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.profiler import (
    ProfileGrid,
    cache_path,
    default_cache_dir,
    load_or_profile,
)
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.worker import Worker
from kvcake.units import parse_size


def register(subparsers: Any) -> None:
    w, e = WorkerConfig(), EngineConfig()
    p = subparsers.add_parser("worker", help="run one prefill / decode / colocated worker",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--role", default=w.role.value, help=" | ".join(r.value for r in Role))
    p.add_argument("--worker-id", default=w.worker_id)
    p.add_argument("--master", default=w.master,
                   help="store master HOST:PORT (default: no store node, no store reuse)")
    p.add_argument("--store-dram-bytes", default=str(w.store_dram_bytes))
    p.add_argument("--num-threads", type=int, default=w.num_threads)
    p.add_argument("--no-layerwise", action="store_true",
                   help="prefill: send the KV after the prefill, not layer by layer during it")
    p.add_argument("--no-shared-memory", action="store_true",
                   help="move KV and store bytes over TCP even to workers on this host")
    p.add_argument("--secret-file", default=None,
                   help="file holding the cluster secret (`kvcake serve` hands its workers one "
                        f"in ${auth.ENV_VAR}; used when neither flag is given)")
    p.add_argument("--secret-env", default=None, metavar="NAME",
                   help="environment variable holding the cluster secret (instead of a file)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default=w.host)
    p.add_argument("--port", type=int, default=w.port)
    _engine_args(p, w.model, e)
    p.set_defaults(func=run_worker)

    q = subparsers.add_parser("profile", help="measure and cache this machine's prefill times",
                              description="Measures prefill times over a grid of (input length,"
                              " prefix length) and decode step times on the engine, fits the "
                              "Conductor's regressions and caches them for `kvcake serve`.")
    q.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    q.add_argument("--num-threads", type=int, default=1)
    q.add_argument("--refresh", action="store_true", help="measure even if a cache exists")
    q.add_argument("--input-lens", default=",".join(map(str, ProfileGrid().input_lens)))
    _engine_args(q, "tiny", e)
    q.set_defaults(func=run_profile)


def _engine_args(p: argparse.ArgumentParser, model: str, e: EngineConfig) -> None:
    p.add_argument("--model", default=model)
    p.add_argument("--kv-cache-bytes", default=str(e.kv_cache_bytes))
    p.add_argument("--block-size", type=int, default=e.block_size)
    p.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=e.max_model_len)
    p.add_argument("--dtype", default=e.dtype)
    p.add_argument("--device", default=e.device)
    p.add_argument("--seed", type=int, default=e.seed)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        kv_cache_bytes=parse_size(args.kv_cache_bytes, "--kv-cache-bytes"),
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, seed=args.seed)


def worker_secret(args: argparse.Namespace) -> ClusterSecret | None:
    """The secret `--secret-file` / `--secret-env` name; else the one `kvcake serve` put in
    `KVCAKE_CLUSTER_SECRET`, if set; else None (open ports). Never read from the command line."""
    file, env = args.secret_file, args.secret_env
    if file is None and env is None:
        if not os.environ.get(auth.ENV_VAR):
            return None
        env = auth.ENV_VAR
    try:
        return ClusterSecret.load(file=file, env=env)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--secret-file/--secret-env: {exc}") from None


def run_worker(args: argparse.Namespace) -> int:
    config = WorkerConfig(
        role=args.role, model=args.model, engine=engine_config(args), host=args.host,
        port=args.port, worker_id=args.worker_id, master=args.master,
        store_dram_bytes=parse_size(args.store_dram_bytes, "--store-dram-bytes"),
        num_threads=args.num_threads, layerwise=not args.no_layerwise,
        shared_memory=not args.no_shared_memory, secret=worker_secret(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    worker = Worker(config)
    try:
        worker.start()
        print(f"kvcake worker ready {worker.worker_id} {worker.address}", flush=True)
        while not stop.wait(0.5) and not worker.shutdown_requested.is_set():
            if args.parent_pid is not None and os.getppid() != args.parent_pid:
                print(f"kvcake worker {worker.worker_id}: parent gone, exiting", file=sys.stderr)
                break
    finally:
        worker.close()
    return 0


def run_profile(args: argparse.Namespace) -> int:
    try:
        lens = tuple(int(x) for x in args.input_lens.split(","))
    except ValueError:
        raise ValueError(f"--input-lens: expected comma-separated integers, got "
                         f"{args.input_lens!r}") from None
    engine = engine_config(args)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    profile = load_or_profile(args.model, engine, cache_dir, ProfileGrid(input_lens=lens),
                              refresh=args.refresh, num_threads=args.num_threads)
    path = cache_path(cache_dir, args.model, engine.dtype, profile.num_threads)
    print(f"profile of {profile.model} ({profile.dtype}, {profile.num_threads} threads): {path}")
    print("input_len prefix_len measured_s predicted_s")
    for p in profile.prefill_points:
        print(f"{p.input_len:9d} {p.prefix_len:10d} {p.time_s:10.4f} "
              f"{profile.prefill.predict(p.input_len, p.prefix_len):11.4f}")
    print("batch context measured_s predicted_s")
    for d in profile.decode_points:
        print(f"{d.batch_size:5d} {d.context_tokens:7d} {d.time_s:10.4f} "
              f"{profile.decode.decode_step_time_s(d.batch_size, d.context_tokens):11.4f}")
    return 0

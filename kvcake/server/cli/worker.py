"""`kvcake worker` (one prefill, decode, colocated or cpp worker: a CPP group's stage, loading
only its slice of the layers) and `kvcake profile`.

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
from dataclasses import replace
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
from kvcake.server.cluster.settings import (
    EngineSettings,
    WorkerIdentity,
    WorkerSettings,
    add_flags,
    configure_logging,
    from_namespace,
    worker_config,
)
from kvcake.server.worker import faults
from kvcake.server.worker.config import WorkerConfig
from kvcake.server.worker.worker import Worker


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("worker", help="run one prefill / decode / colocated / cpp worker",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # Settings come from kvcake/server/cluster/settings.py (the launcher's argv is derived from
    # the same models); only what never travels on a command line is declared here.
    for section in (WorkerIdentity, WorkerSettings, EngineSettings):
        add_flags(p.add_argument_group(section.__name__), section)
    p.add_argument("--secret-file", default=None,
                   help="file holding the cluster secret (`kvcake serve` hands its workers one "
                        f"in ${auth.ENV_VAR}; used when neither flag is given)")
    p.add_argument("--secret-env", default=None, metavar="NAME",
                   help="environment variable holding the cluster secret (instead of a file)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_worker)

    q = subparsers.add_parser("profile", help="measure and cache this machine's prefill times",
                              description="Measures prefill times over a grid of (input length,"
                              " prefix length) and decode step times on the engine, fits the "
                              "Conductor's regressions and caches them for `kvcake serve`.")
    q.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    q.add_argument("--num-threads", type=int, default=1)
    q.add_argument("--refresh", action="store_true", help="measure even if a cache exists")
    q.add_argument("--input-lens", default=None, metavar="N,N,...",
                   help="prompt lengths to measure (default: doubling up to the longest prompt "
                        "the engine takes, at most 8,192 tokens or the first cold prefill "
                        "over 2 s: ProfileGrid.spanning)")
    q.add_argument("--model", default="tiny")
    add_flags(q.add_argument_group("EngineSettings"), EngineSettings)
    q.set_defaults(func=run_profile)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return from_namespace(EngineSettings, args).to_config()


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return worker_config(from_namespace(WorkerIdentity, args),
                         from_namespace(WorkerSettings, args),
                         from_namespace(EngineSettings, args))


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
    config = replace(worker_config_from_args(args), secret=worker_secret(args))
    configure_logging(config.log_level)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    worker = Worker(config, wrap_transport=faults.wrapper_from_env())  # soak only: env var
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
    grid = None
    if args.input_lens is not None:
        try:
            grid = ProfileGrid(input_lens=tuple(int(x) for x in args.input_lens.split(",")))
        except ValueError as exc:
            raise ValueError(f"--input-lens: expected at least 3 comma-separated integers >= 2, "
                             f"got {args.input_lens!r} ({exc})") from None
    engine = engine_config(args)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    profile = load_or_profile(args.model, engine, cache_dir, grid,
                              refresh=args.refresh, num_threads=args.num_threads)
    path = cache_path(cache_dir, args.model, engine.dtype, profile.num_threads,
                      engine.max_num_batched_tokens)
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

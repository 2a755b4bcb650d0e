"""`kvcake serve`: the OpenAI-compatible server.

Modes (all behind the same HTTP API):
- `disaggregated` (default): the Conductor in the frontend, `--prefill N` prefill and
  `--decode M` decode worker processes, the store master in-process, KV streamed layer by layer
  from prefill to decode (`kvcake.server.cluster.launcher`). `--config FILE` describes a
  cluster of hosts.
- `colocated`: the vLLM-like baseline on the same engine and the same number of workers
  (N + M), each worker prefilling and decoding with its local prefix cache only.
- `single`: one engine instance inside the frontend process, no worker processes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import uvicorn

from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.frontend.api import create_app, listen_socket
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig
from kvcake.units import parse_size


class ServeMode(StrEnum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"
    SINGLE = "single"


@dataclass(frozen=True)
class ServeConfig:
    """Settings of `kvcake serve`; the CLI reads its defaults from here."""

    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = ServeMode.DISAGGREGATED.value
    num_prefill: int = 1
    num_decode: int = 1
    max_waiting_requests: int | None = None
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in {m.value for m in ServeMode}:
            raise ValueError(f"--mode: unknown mode {self.mode!r}; choose one of "
                             f"{', '.join(m.value for m in ServeMode)}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"--prefill / --decode: need at least 1 of each, got "
                             f"{self.num_prefill} and {self.num_decode}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")


def register(subparsers: Any) -> None:
    d, e = ServeConfig(), EngineConfig()
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description=__doc__)
    p.add_argument("--model", default=d.model,
                   help="preset name (tiny, small) or a Hugging Face directory")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0: let the OS choose")
    p.add_argument("--mode", default=d.mode,
                   help=f"{' | '.join(m.value for m in ServeMode)} (default %(default)s)")
    p.add_argument("--prefill", type=int, default=d.num_prefill,
                   help="prefill workers (disaggregated); colocated runs prefill + decode workers")
    p.add_argument("--decode", type=int, default=d.num_decode, help="decode workers")
    p.add_argument("--config", default=None,
                   help="TOML cluster description (see docs/cluster.example.toml); wins over "
                        "--prefill/--decode/--mode")
    p.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="answer 429 while this many requests wait for prefill (default: no limit)")
    p.add_argument("--retry-after-s", type=float, default=d.retry_after_s)
    p.add_argument("--kv-cache-bytes", default=str(e.kv_cache_bytes),
                   help="size of the paged KV pool, e.g. 256MiB")
    p.add_argument("--block-size", type=int, default=e.block_size)
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=e.max_model_len)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--device", default=e.device)
    p.add_argument("--dtype", default=e.dtype)
    p.add_argument("--seed", type=int, default=e.seed, help="seed of a preset's dummy weights")
    p.add_argument("--num-threads", type=int, default=LocalBackendConfig().num_threads,
                   help="torch intra-op threads of each engine (default: torch's in --mode "
                        "single, 1 per worker in the other modes)")
    p.set_defaults(func=serve)


def backend_config(args: argparse.Namespace) -> LocalBackendConfig:
    engine = EngineConfig(
        block_size=args.block_size, kv_cache_bytes=parse_size(args.kv_cache_bytes,
                                                              "--kv-cache-bytes"),
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, seed=args.seed,
        enable_prefix_caching=not args.no_prefix_caching)
    return LocalBackendConfig(model=args.model, engine=engine,
                              max_waiting_requests=args.max_waiting_requests,
                              retry_after_s=args.retry_after_s, num_threads=args.num_threads)


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """`kvcake serve` arguments -> ClusterConfig (`--config FILE` wins over --prefill/--decode;
    `--num-threads` with a file is an error: the file sets `num_threads` per [[workers]])."""
    num_threads = getattr(args, "num_threads", None)
    if getattr(args, "config", None):  # the file's [frontend] section names host and port
        if num_threads is not None:
            raise ValueError("--num-threads: with --config, set num_threads in each [[workers]] "
                             "entry of the file instead")
        return ClusterConfig.from_toml(args.config)
    engine = backend_config(args).engine
    mode = getattr(args, "mode", "disaggregated")
    worker = {"num_threads": num_threads} if num_threads is not None else {}
    return ClusterConfig.simple(getattr(args, "prefill", 1) or 1, getattr(args, "decode", 1) or 1,
                                model=args.model, mode=mode, host=args.host, port=args.port,
                                engine=engine, worker=worker)


def serve(args: argparse.Namespace) -> int:
    config = ServeConfig(model=args.model, host=args.host, port=args.port, mode=args.mode,
                         num_prefill=args.prefill, num_decode=args.decode,
                         max_waiting_requests=args.max_waiting_requests,
                         retry_after_s=args.retry_after_s)
    if args.config or config.mode != ServeMode.SINGLE:
        from kvcake.server.cluster.launcher import serve_disaggregated

        if config.mode == ServeMode.COLOCATED:  # the same number of workers, all colocated
            args.prefill, args.decode = config.num_prefill + config.num_decode, 0
        return serve_disaggregated(config_from_args(args))
    backend = LocalBackend.from_config(backend_config(args))
    # Bind first, so that --port 0 can report the port it got before serving.
    sock = listen_socket(config.host, config.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(backend), log_level="warning",
                                           lifespan="off"))
    backend.start()
    print(f"kvcake serve: http://{config.host}:{port} (model {backend.model_name}, mode "
          f"{config.mode}, max_model_len {backend.max_model_len})", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        backend.close()
        sock.close()
    return 0

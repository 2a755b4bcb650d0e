"""`kvcake serve [MODEL]`: the OpenAI-compatible server.

Modes (all behind the same HTTP API):
- `disaggregated` (default): the Conductor in the frontend, `--prefill N` prefill and
  `--decode M` decode worker processes, the store master in-process, KV streamed layer by layer
  from prefill to decode (`kvcake.server.cluster.launcher`). `--config FILE` describes a
  cluster of hosts.
- `colocated`: the vLLM-like baseline on the same engine and the same number of workers
  (N + M), each worker prefilling and decoding with its local prefix cache only.
- `single`: one engine instance inside the frontend process, no worker processes.

Every flag comes from `kvcake/server/cluster/settings.py` (add a new one there); this module maps
each to what uses it in each mode, and a flag that does not apply to the mode is an error.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from enum import StrEnum
from typing import Any

from kvcake.conductor import ConductorConfig
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.settings import (
    EngineSettings,
    ServeSettings,
    WorkerSettings,
    add_flags,
    configure_logging,
    flag_name,
    from_namespace,
    modes_of,
    set_by_user,
)
from kvcake.server.frontend.api_key import resolve_api_key
from kvcake.server.frontend.limits import HttpLimits
from kvcake.server.frontend.local_backend import LocalBackendConfig

_SECTIONS: tuple[type[Any], ...] = (ServeSettings, WorkerSettings, EngineSettings)


class ServeMode(StrEnum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"
    SINGLE = "single"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    for section in _SECTIONS:
        add_flags(p.add_argument_group(section.__name__), section)
    p.set_defaults(func=serve)


def settings_from_args(args: argparse.Namespace) -> tuple[ServeSettings, WorkerSettings,
                                                         EngineSettings]:
    """The three sections, checked: a flag set for a mode it does not apply to is an error."""
    serve = from_namespace(ServeSettings, args)
    if serve.mode not in {m.value for m in ServeMode}:
        raise ValueError(f"--mode: unknown mode {serve.mode!r}; choose one of "
                         f"{', '.join(m.value for m in ServeMode)}")
    if serve.etcd is None and (serve.prefill < 1 or serve.decode < 1):
        raise ValueError(f"--prefill / --decode: need at least 1 of each, got "
                         f"{serve.prefill} and {serve.decode} (with --etcd, 0: serve only the "
                         "workers that register there)")
    if serve.prefill < 0 or serve.decode < 0:
        raise ValueError(f"--prefill / --decode: must be >= 0, got {serve.prefill} and "
                         f"{serve.decode}")
    if serve.secret_file and serve.secret_env:
        raise ValueError("--secret-file / --secret-env: give one of them, not both")
    if not 0 <= serve.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {serve.port}")
    cpp_flags = [serve.cpp_nodes, serve.cpp_min_tokens, serve.cpp_chunk_tokens]
    if serve.config and any(v is not None for v in cpp_flags):
        raise ValueError("--cpp-nodes / --cpp-min-tokens / --cpp-chunk-tokens: with --config, "
                         "set [conductor] cpp_min_tokens, cpp_nodes, cpp_chunk_tokens and the "
                         "[[workers]] role = \"cpp\" entries in the file instead")
    if serve.cpp_chunk_tokens is not None and serve.cpp_nodes is None and \
            serve.cpp_min_tokens is None:
        raise ValueError("--cpp-chunk-tokens: applies to a CPP group; give --cpp-nodes X "
                         "(and --cpp-min-tokens T) too")
    if serve.cpp_nodes is not None and serve.cpp_nodes < 2:
        raise ValueError(f"--cpp-nodes: a CPP group pipelines over >= 2 workers, got "
                         f"{serve.cpp_nodes}")
    worker, engine = from_namespace(WorkerSettings, args), from_namespace(EngineSettings, args)
    mode = "disaggregated" if serve.config else serve.mode  # a file says its own mode
    for section in _SECTIONS:
        for name in set_by_user(section, args):
            if serve.config and section is not ServeSettings:
                raise ValueError(f"{flag_name(section, name)}: with --config, set {name} in "
                                 f"the file ([engine] or each [[workers]] entry) instead")
            if serve.config is None and mode not in modes_of(section, name):
                raise ValueError(f"{flag_name(section, name)}: applies only to --mode "
                                 f"{' / '.join(modes_of(section, name))}, not {mode}")
    return serve, worker, engine


def local_config(args: argparse.Namespace) -> LocalBackendConfig:
    """`--mode single`: the settings of the in-process engine."""
    serve, worker, engine = settings_from_args(args)
    return LocalBackendConfig(model=serve.model, engine=engine.to_config(),
                              max_waiting_requests=serve.max_waiting_requests,
                              retry_after_s=serve.retry_after_s,
                              num_threads=worker.num_threads,
                              bind_threads=serve.bind_threads,
                              bind_engine_thread=serve.bind_engine_thread,
                              engine_process=serve.engine_process,
                              served_model_names=serve.served_model_name or ())


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """`kvcake serve` arguments -> ClusterConfig (`--config FILE` wins over --prefill/--decode;
    the frontend's and Conductor's flags apply to a file's cluster too)."""
    serve, worker, engine = settings_from_args(args)
    if serve.config:  # the file's [frontend] section names host and port
        config = ClusterConfig.from_toml(serve.config)
    else:
        workers = serve.prefill + serve.decode if serve.mode == "colocated" else serve.prefill
        options = {k: v for k, v in worker.model_dump().items() if v is not None}
        etcd = {"etcd_endpoints": tuple(serve.etcd.split(",")) if serve.etcd else (),
                "etcd_cluster": serve.cluster}
        cpp = cpp_conductor(serve)
        config = ClusterConfig.simple(workers, serve.decode,
                                      cpp.cpp_nodes if cpp.cpp_min_tokens is not None else 0,
                                      model=serve.model, mode=serve.mode,
                                      host=serve.host, port=serve.port,
                                      engine=engine.to_config(), worker=options,
                                      conductor=cpp, **etcd)
    conductor = replace(config.conductor, min_retry_after_s=serve.retry_after_s)
    if serve.config and serve.etcd:  # the flags name the etcd of a file's cluster too
        config = replace(config, etcd_endpoints=tuple(serve.etcd.split(",")),
                         etcd_cluster=serve.cluster)
    elif serve.config and getattr(args, "cluster", None) is not None:
        config = replace(config, etcd_cluster=serve.cluster)
    if serve.secret_file or serve.secret_env:  # the flags win over a file's [security]
        config = replace(config, secret_file=serve.secret_file, secret_env=serve.secret_env)
    return replace(config, conductor=conductor,
                   max_waiting_requests=serve.max_waiting_requests,
                   served_model_names=serve.served_model_name or config.served_model_names)


def cpp_conductor(serve: ServeSettings) -> ConductorConfig:
    """The Conductor's CPP settings from the serve flags (ConductorConfig checks them).
    `--cpp-nodes X` alone: prompts of X chunks or more go to the group; `--cpp-min-tokens T`
    alone: a group of 2."""
    if serve.cpp_nodes is None and serve.cpp_min_tokens is None:
        return ConductorConfig()
    nodes = ConductorConfig.cpp_nodes if serve.cpp_nodes is None else serve.cpp_nodes
    chunk = ConductorConfig.cpp_chunk_tokens if serve.cpp_chunk_tokens is None \
        else serve.cpp_chunk_tokens
    threshold = nodes * chunk if serve.cpp_min_tokens is None else serve.cpp_min_tokens
    try:
        return ConductorConfig(cpp_nodes=nodes, cpp_chunk_tokens=chunk, cpp_min_tokens=threshold)
    except ValueError as exc:
        raise ValueError(f"--cpp-nodes / --cpp-min-tokens / --cpp-chunk-tokens: {exc}") from None


def http_limits(settings: ServeSettings) -> HttpLimits:
    """What the HTTP API reads from a client before real work (the same in every mode)."""
    return HttpLimits(max_request_bytes=settings.max_request_bytes,
                      max_json_depth=settings.max_json_depth,
                      max_prompt_chars=settings.max_prompt_chars)


def switch_interval_s(settings: ServeSettings) -> float:
    """`--switch-interval-ms` in seconds, as `sys.setswitchinterval` takes it."""
    if not settings.switch_interval_ms > 0:
        raise ValueError(f"--switch-interval-ms must be > 0 (Python's default is 5), got "
                         f"{settings.switch_interval_ms}")
    return settings.switch_interval_ms / 1000.0


def serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)[0]
    configure_logging(settings.log_level)
    api_key = resolve_api_key(settings.api_key)  # --api-key, else $KVCAKE_API_KEY
    limits = http_limits(settings)
    if settings.config or settings.mode != ServeMode.SINGLE:
        from kvcake.server.cluster.launcher import serve_disaggregated

        return serve_disaggregated(config_from_args(args), api_key=api_key, limits=limits)
    return _serve_single(settings, local_config(args), api_key, limits)


def _serve_single(settings: ServeSettings, config: LocalBackendConfig,
                  api_key: str | None = None, limits: HttpLimits | None = None) -> int:
    import uvicorn

    from kvcake.conductor.heap import freeze_heap
    from kvcake.server.frontend.api import create_app
    from kvcake.server.frontend.http_server import listen_socket
    from kvcake.server.frontend.local_backend import LocalBackend
    from kvcake.server.frontend.process_backend import ProcessBackend

    sys.setswitchinterval(switch_interval_s(settings))
    backend: LocalBackend | ProcessBackend
    if config.engine_process:
        backend = ProcessBackend(config)  # the engine is built when it starts, in its process
    else:
        backend = LocalBackend.from_config(config)
    # Bind first, so that --port 0 can report the port it got before serving.
    sock = listen_socket(settings.host, settings.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(backend, api_key=api_key, limits=limits),
                                           log_level="warning",
                                           lifespan="off"))
    # The engine, torch, the tokenizer and the app are loaded (~200k objects): keep the collector
    # off them, or a full collection (60-140 ms here) lands between two decode steps.
    freeze_heap()
    backend.start()
    print(f"kvcake serve: http://{settings.host}:{port} (model {backend.model_name}, mode "
          f"{settings.mode}, max_model_len {backend.max_model_len})", file=sys.stderr,
          flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        backend.close()
        sock.close()
    return 0

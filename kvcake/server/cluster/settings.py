"""One schema for every serving setting: the `kvcake serve` and `kvcake worker` flags, the
cluster TOML's `[engine]` and `[[workers]]` keys and the argv the launcher starts a worker with are
all derived from the pydantic models below, so a setting cannot be dropped on the way.

Where a new setting goes (one field, with its help text; nothing else to copy by hand):
- `EngineSettings`: a knob of every engine (each worker's, and `--mode single`'s). It mirrors
  `EngineConfig` field by field (tests/server/cli/test_settings.py checks it).
- `WorkerSettings`: a knob of each worker process (its store node, threads, transport); a serve
  flag (every launched worker), a `[[workers]]` key and a `kvcake worker` flag.
- `WorkerIdentity`: what only `kvcake worker` takes (role, address, master); the launcher fills it.
- `ServeSettings`: a knob of the frontend or the Conductor (`kvcake serve` only); map it in
  `kvcake/server/cli/serve.py` (`cluster_config` / `local_config`) to what uses it.

A field's `modes` (json_schema_extra) names the serve modes it applies to; a serve flag set away
from its default in another mode is an error that says so (never silently ignored).
Booleans become `--name / --no-name`; sizes ("256MiB") are parsed by `kvcake.units`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import fields as dc_fields
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvcake.engine.config import EngineConfig
from kvcake.server.worker.config import WorkerConfig
from kvcake.units import parse_size

__all__ = ["ALL_MODES", "EngineSettings", "ServeSettings", "WorkerIdentity", "WorkerSettings",
           "add_flags", "build", "flag_name", "from_namespace", "modes_of", "to_argv",
           "worker_argv_settings", "worker_config"]

ALL_MODES = ("disaggregated", "colocated", "single")
_E, _W = EngineConfig(), WorkerConfig()


def _size(value: Any) -> Any:
    return parse_size(value, "size") if isinstance(value, str) else value


Size = Annotated[int, BeforeValidator(_size)]


def setting(default: Any, help: str, *, flag: str | None = None,
            modes: Iterable[str] = ALL_MODES, positional: bool = False) -> Any:
    """A field with its help, its flag name (default: the field name with dashes) and the serve
    modes it applies to."""
    return Field(default, description=help,
                 json_schema_extra={"flag": flag, "modes": list(modes),
                                    "positional": positional})


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class EngineSettings(_Settings):
    """-> `EngineConfig` (every field of it; `to_config`)."""

    block_size: int = setting(_E.block_size, "tokens per KV block")
    kv_cache_bytes: Size = setting(_E.kv_cache_bytes, "size of the paged KV pool, e.g. 256MiB")
    num_blocks: int | None = setting(_E.num_blocks, "KV blocks (overrides --kv-cache-bytes)")
    max_num_batched_tokens: int = setting(_E.max_num_batched_tokens,
                                          "token budget of one engine step")
    max_num_seqs: int = setting(_E.max_num_seqs, "requests in one batch at most")
    max_model_len: int | None = setting(_E.max_model_len,
                                        "context length (default: the model's)")
    dtype: str = setting(_E.dtype, "float32 | bfloat16 | float16")
    device: str = setting(_E.device, "auto | cpu | cuda[:N]")
    seed: int = setting(_E.seed, "seed of a preset's dummy weights")
    enable_prefix_caching: bool = setting(_E.enable_prefix_caching,
                                          "reuse cached prompt prefixes", flag="prefix-caching")
    linear_backend: str = setting(_E.linear_backend,
                                  "CPU GEMM backend: auto | aten | aten_t | onednn | mkl_gemv | mkl_split")
    attention: str = setting(_E.attention, "decode attention: auto | kernel | gather")

    def to_config(self) -> EngineConfig:
        return EngineConfig(**self.model_dump())

    @classmethod
    def of(cls, config: EngineConfig) -> EngineSettings:
        return cls(**{name: getattr(config, name) for name in cls.model_fields})


class WorkerSettings(_Settings):
    """Each worker process's own knobs (-> `WorkerConfig`); also `[[workers]]` keys."""

    store_dram_bytes: Size = setting(_W.store_dram_bytes,
                                     "DRAM each worker gives the store pool, e.g. 64MiB",
                                     modes=("disaggregated",))
    num_threads: int | None = setting(None, "torch intra-op threads of each engine (default: "
                                      "torch's in --mode single and kvcake worker, 1 per "
                                      "launched worker)")
    layerwise: bool = setting(_W.layerwise, "prefill: stream the KV layer by layer during the "
                              "compute (--no-layerwise: after it)", modes=("disaggregated",))
    shared_memory: bool = setting(_W.shared_memory, "move KV and store bytes to same-host "
                                  "workers through shared memory (--no-shared-memory: TCP)",
                                  modes=("disaggregated",))
    kv_events_endpoint: str | None = setting(
        None, "publish each worker's KV cache events as vLLM's KVEventBatch (msgpack) on a ZMQ "
        "PUB socket bound here: tcp://HOST:* (each worker its own port, logged) or "
        "tcp://HOST:PORT (one worker)", modes=("disaggregated", "colocated"))
    metrics_port: int | None = setting(
        None, "serve each worker's own Prometheus /metrics on this port of its --host (0: any "
        "port, logged)", modes=("disaggregated", "colocated"))


class WorkerIdentity(_Settings):
    """What `kvcake worker` alone takes: who it is and where it listens."""

    role: str = setting(_W.role.value, "prefill | decode | colocated | cpp (one stage of a "
                        "chunked-pipeline-parallel prefill group)")
    worker_id: str | None = setting(_W.worker_id, "default: the role and a random suffix")
    host: str = setting(_W.host, "address the control port binds")
    port: int = setting(_W.port, "control port (0: the OS picks)")
    advertise_host: str | None = setting(_W.advertise_host, "the address other hosts dial "
                                         "(default: --host)")
    etcd: str | None = setting(getattr(_W, "etcd", None), "etcd endpoints HOST:PORT[,HOST:PORT]"
                               ": register there, so a frontend watching --cluster takes "
                               "this worker in")
    cluster: str = setting(getattr(_W, "cluster", "kvcake"), "the cluster's name in etcd")
    master: str | None = setting(_W.master, "store master HOST:PORT (default: no store node, "
                                 "no store reuse)")
    model: str = setting(_W.model, "preset name (tiny, small) or a Hugging Face directory")
    log_level: str = setting(_W.log_level, "debug | info | warning | error (launched workers: "
                             "the frontend's --log-level)")
    cpp_member: int | None = setting(_W.cpp_member, "role cpp: this worker's stage (0-based) in "
                                     "its group; it loads only that slice of the layers")
    cpp_nodes: int = setting(_W.cpp_nodes, "role cpp: the members of its group (the serve's "
                             "--cpp-nodes)")
    cpp_chunk_tokens: int = setting(_W.cpp_chunk_tokens, "role cpp: the largest chunk of hidden "
                                    "states it takes (the serve's --cpp-chunk-tokens)")


class ServeSettings(_Settings):
    """The frontend's and the Conductor's knobs (`kvcake serve` only)."""

    model: str = setting("tiny", "preset name (tiny, small) or a Hugging Face directory; also "
                         "the positional MODEL", positional=True)
    served_model_name: tuple[str, ...] | None = setting(
        None, "the name(s) clients use for the model (several: each is accepted, the first is "
        "reported); default: the model's directory name")
    host: str = setting("127.0.0.1", "address the HTTP API binds")
    port: int = setting(8000, "HTTP port (0: the OS picks)")
    mode: str = setting("disaggregated", "disaggregated | colocated | single")
    prefill: int = setting(1, "prefill workers (disaggregated); colocated runs prefill + decode "
                           "workers", modes=("disaggregated", "colocated"))
    decode: int = setting(1, "decode workers", modes=("disaggregated", "colocated"))
    config: str | None = setting(None, "TOML cluster description (docs/cluster.example.toml); "
                                 "wins over --prefill/--decode/--mode",
                                 modes=("disaggregated", "colocated"))
    max_waiting_requests: int | None = setting(
        None, "answer 429 while this many requests wait for their first token (default: no "
        "limit)")
    bind_threads: bool = setting(
        True, "bind the engine's torch threads (2 or more) one per CPU, on the lowest CPUs of "
        "this process's affinity (taskset chooses them), as vLLM's CPU launcher binds its "
        "worker's OpenMP threads: a step's threads never share a core; --no-bind-threads: the "
        "kernel places them",
        modes=("single",))
    bind_engine_thread: bool = setting(
        True, "with --bind-threads: the engine thread (torch's thread 0) is bound too; "
        "--no-bind-engine-thread: only torch's worker threads are, the engine thread floats "
        "with the HTTP threads", modes=("single",))
    engine_process: bool = setting(
        False, "run the engine loop in a child process of its own (as vLLM's engine core), so "
        "the HTTP thread never holds the interpreter lock the engine needs; off: the engine is "
        "a thread of the serving process", modes=("single",))
    switch_interval_ms: float = setting(
        5.0, "the Python thread switch interval (sys.setswitchinterval) of the serving process, "
        "in milliseconds: how long the engine thread may wait for the interpreter lock the HTTP "
        "thread holds before a forced switch (Python's default: 5)", modes=("single",))
    retry_after_s: float = setting(1.0, "Retry-After of a 429 (the Conductor's floor of its "
                                   "estimate)")
    log_level: str = setting("info", "debug | info | warning | error")
    api_key: str | None = setting(
        None, "clients must send 'Authorization: Bearer KEY' on /v1 (as vllm serve --api-key; "
        "401 otherwise); default: $KVCAKE_API_KEY; /health and /metrics stay open")
    max_request_bytes: Size = setting(8 * 2**20, "largest request body the HTTP API reads, e.g. "
                                      "8MiB (413 naming the cap above it)")
    max_json_depth: int = setting(64, "deepest JSON nesting the HTTP API parses (400 above it)")
    max_prompt_chars: int | None = setting(
        None, "longest text prompt, in characters, the HTTP API tokenizes (400 above it); "
        "default: 16 per token of the model's max length")
    cpp_nodes: int | None = setting(
        None, "chunked pipeline parallelism: launch this many more workers (role cpp), one "
        "pipelined prefill group, each holding 1/X of the layers; prompts of --cpp-min-tokens "
        "or more (default: X chunks) go to the group, the rest to the --prefill workers "
        "(docs/cluster.md)",
        modes=("disaggregated",))
    cpp_min_tokens: int | None = setting(
        None, "prompts of at least this many tokens are prefilled by the CPP group (alone: a "
        "group of --cpp-nodes 2)", modes=("disaggregated",))
    cpp_chunk_tokens: int | None = setting(
        None, "tokens per pipelined chunk (default 1024; at least 1,000, as the paper)",
        modes=("disaggregated",))
    etcd: str | None = setting(None, "etcd endpoints HOST:PORT[,HOST:PORT]: serve the workers "
                               "that register there (--prefill 0 --decode 0: only those) and "
                               "use the elected store master (none of its own); docs/cluster.md",
                               modes=("disaggregated",))
    cluster: str = setting("kvcake", "the cluster's name in etcd", modes=("disaggregated",))
    secret_file: str | None = setting(
        None, "file holding the cluster secret (readable by its owner only) that every internal "
        "port admits; give workers started elsewhere the same (kvcake worker --secret-file); "
        "wins over a --config file's [security]; default: a fresh secret",
        modes=("disaggregated", "colocated"))
    secret_env: str | None = setting(
        None, "environment variable holding the cluster secret (instead of --secret-file)",
        modes=("disaggregated", "colocated"))


def flag_name(model: type[BaseModel], name: str) -> str:
    extra = model.model_fields[name].json_schema_extra
    flag = extra.get("flag") if isinstance(extra, dict) else None
    return "--" + str(flag or name.replace("_", "-"))


def modes_of(model: type[BaseModel], name: str) -> tuple[str, ...]:
    extra = model.model_fields[name].json_schema_extra
    return tuple(extra["modes"]) if isinstance(extra, dict) else ALL_MODES  # type: ignore[arg-type]


def _positional(model: type[BaseModel], name: str) -> bool:
    extra = model.model_fields[name].json_schema_extra
    return bool(isinstance(extra, dict) and extra.get("positional"))


def _scalar(annotation: Any) -> type:
    """int, float, str or bool of a field type (Optional and Annotated unwrapped)."""
    for kind in (bool, int, float):
        text = str(annotation)
        if annotation is kind or text.startswith(f"{kind.__name__} |") or \
                text.startswith(f"typing.Annotated[{kind.__name__},"):
            return kind
    return str


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel],
              skip: Iterable[str] = ()) -> None:
    """One flag per field of `model` (defaults stay None, so `from_namespace` sees what the
    user set)."""
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag, text = flag_name(model, name), info.description or ""
        default = info.default
        shown = f"{text} (default: {default})" if default not in (None, ()) else text
        shown = shown.replace("%", "%%")
        if _positional(model, name):
            parser.add_argument(f"{name}_positional", nargs="?", default=None,
                                metavar=name.upper(), help=f"same as {flag}")
        if info.annotation is not None and "tuple" in str(info.annotation):
            parser.add_argument(flag, dest=name, nargs="+", default=None, help=shown)
        elif _scalar(info.annotation) is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=shown)
        else:
            kind = _scalar(info.annotation)
            parsed = any(isinstance(m, BeforeValidator) for m in info.metadata)  # a Size
            parser.add_argument(flag, dest=name, type=str if parsed else kind, default=None,
                                help=shown)


T = TypeVar("T", bound=BaseModel)


def build(model: type[T], values: dict[str, Any], section: str | None = None) -> T:
    """`model(**values)`; a validation error becomes one ValueError line naming the flag (or,
    for a config file's `section`, the key)."""
    try:
        return model(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            raise ValueError(f"{section or model.__name__}: unknown key {name!r}; known keys are "
                             f"{sorted(model.model_fields)}") from None
        where = name if section is not None or name not in model.model_fields \
            else flag_name(model, name)
        message = str(err.get("ctx", {}).get("error", err["msg"]))
        if message.startswith("size: "):
            message = message[len("size: "):]
        raise ValueError(f"{where}: {message}") from None


def from_namespace(model: type[T], args: argparse.Namespace) -> T:
    """The settings the user gave (flags left at None take the model's defaults)."""
    values = {name: getattr(args, name) for name in model.model_fields
              if getattr(args, name, None) is not None}
    positional = {name: getattr(args, f"{name}_positional") for name in model.model_fields
                  if getattr(args, f"{name}_positional", None) is not None}
    for name, value in positional.items():
        if name in values and values[name] != value:
            raise ValueError(f"{flag_name(model, name)}: given twice ({value!r} and "
                             f"{values[name]!r}); give one")
        values[name] = value
    return build(model, values)


def set_by_user(model: type[BaseModel], args: argparse.Namespace) -> set[str]:
    return {name for name in model.model_fields
            if getattr(args, name, None) is not None
            or getattr(args, f"{name}_positional", None) is not None}


def to_argv(settings: BaseModel) -> list[str]:
    """The flags that give `settings` back through `add_flags` + `from_namespace`."""
    model = type(settings)
    argv: list[str] = []
    for name in model.model_fields:
        value, flag = getattr(settings, name), flag_name(model, name)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def configure_logging(level: str) -> None:
    """Structured log lines on stderr at `level` (--log-level of serve and worker)."""
    import logging
    import sys

    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"--log-level: unknown level {level!r}; choose debug, info, warning "
                         "or error")
    logging.basicConfig(level=numeric, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def current_log_level() -> str:
    """The root logger's level by name (what launched workers inherit)."""
    import logging

    return str(logging.getLevelName(logging.getLogger().getEffectiveLevel())).lower()


# -- a worker: WorkerConfig <-> settings -------------------------------------------------------
_IDENTITY = tuple(WorkerIdentity.model_fields)
# WorkerConfig fields that never go on a command line: the cluster secret travels in the
# child's environment (the launcher), never in argv, which other users can read.
_NOT_ARGV = frozenset({"secret"})


def worker_config(identity: WorkerIdentity, worker: WorkerSettings,
                  engine: EngineSettings) -> WorkerConfig:
    return WorkerConfig(**identity.model_dump(), **worker.model_dump(),
                        engine=engine.to_config())


def worker_argv_settings(config: WorkerConfig) -> list[str]:
    """The `kvcake worker` flags that rebuild `config` (every field of it)."""
    names = {f.name for f in dc_fields(config)}
    known = set(_IDENTITY) | set(WorkerSettings.model_fields) | {"engine"} | _NOT_ARGV
    if names - known:  # a WorkerConfig field with no setting would be dropped here
        raise AssertionError(f"WorkerConfig fields without a setting: {sorted(names - known)}")
    identity = WorkerIdentity(**{n: getattr(config, n) for n in _IDENTITY if n != "role"},
                              role=config.role.value)
    worker = WorkerSettings(**{n: getattr(config, n) for n in WorkerSettings.model_fields})
    return to_argv(identity) + to_argv(worker) + to_argv(EngineSettings.of(config.engine))

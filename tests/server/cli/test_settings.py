"""Every `kvcake serve` flag, walked through every mode to what uses it.

For each setting of `kvcake/server/cluster/settings.py` and each serve mode, the flag is given a
value away from its default and followed to the object that acts on it: `--mode single`'s
`LocalBackendConfig` (its engine), or in the cluster modes the `DisaggConfig` of the frontend and
the Conductor, and each launched worker's `WorkerConfig` after a round trip through the argv the
launcher starts it with and the `kvcake worker` parser. A flag that does not apply to a mode must
be an error there. A new setting without a value in `VALUES` fails `test_every_setting_is_walked`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcake.auth import ClusterSecret
from kvcake.cli import build_parser
from kvcake.engine.config import EngineConfig
from kvcake.server.cli import serve as serve_cli
from kvcake.server.cli import worker as worker_cli
from kvcake.server.cli.serve import (
    config_from_args,
    http_limits,
    local_config,
    settings_from_args,
    switch_interval_s,
)
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster, worker_argv
from kvcake.server.cluster.settings import (
    ALL_MODES,
    EngineSettings,
    ServeSettings,
    WorkerSettings,
    flag_name,
    modes_of,
)
from kvcake.server.frontend.api_key import resolve_api_key
from kvcake.server.worker.config import Role, WorkerConfig

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "cluster.example.toml"
# --secret-file / --secret-env: the file and the variable hold this secret (`_secret_sources`)
SECRET = ClusterSecret(b"the-settings-walk-secret-of-enough-length")
SECRET_FILE = str(Path(tempfile.gettempdir()) / f"kvcake-settings-walk-{os.getpid()}.secret")
SECRET_ENV = "KVCAKE_SETTINGS_WALK_SECRET"

# setting -> (command-line value, the value its user must see)
VALUES: dict[str, tuple[Any, Any]] = {
    # ServeSettings
    "model": ("small", "small"),
    "served_model_name": (["alpha", "beta"], ("alpha", "beta")),
    "host": ("127.0.0.2", "127.0.0.2"),
    "port": ("1234", 1234),
    "mode": (None, None),  # the loop variable itself
    "prefill": ("2", 2),
    "decode": ("3", 3),
    "config": (str(EXAMPLE), None),
    "max_waiting_requests": ("7", 7),
    "retry_after_s": ("2.5", 2.5),
    "bind_threads": (False, False),  # on by default: --no-bind-threads
    "bind_engine_thread": (False, False),
    "switch_interval_ms": ("20", 20.0),
    "engine_process": (True, True),
    "log_level": ("debug", "debug"),
    "api_key": ("sk-walk", "sk-walk"),
    "max_request_bytes": ("1MiB", 2**20),
    "max_json_depth": ("9", 9),
    "max_prompt_chars": ("4000", 4000),
    "etcd": ("10.0.0.1:2379,10.0.0.2:2379", "10.0.0.1:2379,10.0.0.2:2379"),
    "cluster": ("blue", "blue"),
    "secret_file": (SECRET_FILE, SECRET),
    "secret_env": (SECRET_ENV, SECRET),
    "cpp_nodes": ("3", 3),
    "cpp_min_tokens": ("3000", 3000),
    "cpp_chunk_tokens": ("2000", 2000),
    # WorkerSettings
    "store_dram_bytes": ("8MiB", 8 * 2**20),
    "num_threads": ("3", 3),
    "layerwise": (False, False),
    "shared_memory": (False, False),
    "kv_events_endpoint": ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
    "metrics_port": ("0", 0),
    # EngineSettings
    "block_size": ("32", 32),
    "kv_cache_bytes": ("8MiB", 8 * 2**20),
    "num_blocks": ("77", 77),
    "max_num_batched_tokens": ("999", 999),
    "max_num_seqs": ("9", 9),
    "max_model_len": ("500", 500),
    "dtype": ("bfloat16", "bfloat16"),
    "device": ("cpu", "cpu"),
    "seed": ("5", 5),
    "enable_prefix_caching": (False, False),
    "linear_backend": ("aten", "aten"),
    "attention": ("gather", "gather"),
}
HTTP_LIMITS = ("max_request_bytes", "max_json_depth", "max_prompt_chars")
SECTIONS = (ServeSettings, WorkerSettings, EngineSettings)
WALKED = [(section, name) for section in SECTIONS for name in section.model_fields
          if name != "mode"]


@pytest.fixture(autouse=True)
def _secret_sources(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SECRET in SECRET_FILE and in $SECRET_ENV, for the walk of --secret-file / --secret-env."""
    Path(SECRET_FILE).unlink(missing_ok=True)
    SECRET.write(SECRET_FILE)
    monkeypatch.setenv(SECRET_ENV, SECRET.text())
    yield
    Path(SECRET_FILE).unlink(missing_ok=True)


# flags that act only beside another one: what the walk gives with them
COMPANIONS = {"cpp_chunk_tokens": ["--cpp-nodes", "2"]}


def _argv(section: type, name: str) -> list[str]:
    flag, (value, _) = flag_name(section, name), VALUES[name]
    if name in COMPANIONS:
        return [*COMPANIONS[name], flag, value]
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, *value] if isinstance(value, list) else [flag, value]


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser("serve").parse_args(["serve", *argv])


def _worker_configs(cluster_config: ClusterConfig) -> list[WorkerConfig]:
    """What each launched worker process builds from the argv the launcher gives it."""
    cluster = Cluster(cluster_config)
    parser = argparse.ArgumentParser()
    worker_cli.register(parser.add_subparsers())
    configs = []
    for i, spec in enumerate(cluster_config.workers):
        argv = worker_argv(cluster.worker_config(f"{spec.role.value}-{i}", spec),
                           parent_pid=None)
        args = parser.parse_args(argv[argv.index("worker"):])
        configs.append(worker_cli.worker_config_from_args(args))
    return configs


def _observed(name: str, mode: str, args: argparse.Namespace) -> list[Any]:
    """Every value of `name` that the parts of `mode` act on."""
    if name == "log_level":  # applied by serve() before any mode starts
        return [settings_from_args(args)[0].log_level]
    if name == "api_key":  # resolved by serve() and handed to create_app in every mode
        return [resolve_api_key(settings_from_args(args)[0].api_key)]
    if name in HTTP_LIMITS:  # built by serve() and handed to create_app in every mode
        return [getattr(http_limits(settings_from_args(args)[0]), name)]
    if mode == "single" and args.config is None:
        if name == "switch_interval_ms":  # set by serve() on the process before it serves
            return [1000 * switch_interval_s(settings_from_args(args)[0])]
        local = local_config(args)
        if name in EngineSettings.model_fields:
            return [getattr(local.engine, name)]
        return [{"model": local.model, "served_model_name": local.served_model_names,
                 "max_waiting_requests": local.max_waiting_requests,
                 "retry_after_s": local.retry_after_s, "num_threads": local.num_threads,
                 "bind_threads": local.bind_threads,
                 "bind_engine_thread": local.bind_engine_thread,
                 "engine_process": local.engine_process,
                 "host": settings_from_args(args)[0].host,
                 "port": settings_from_args(args)[0].port}[name]]
    cluster = config_from_args(args)
    launcher = Cluster(cluster)
    launcher.addresses = {"w0": "127.0.0.1:1"}  # as if started (backend_config reads them)
    frontend = launcher.backend_config()
    workers = _worker_configs(cluster)
    if name in EngineSettings.model_fields:
        return [getattr(w.engine, name) for w in workers]
    if name in WorkerSettings.model_fields:
        return [getattr(w, name) for w in workers]
    roles = [w.role for w in workers]
    seen: dict[str, list[Any]] = {
        "model": [frontend.model, *(w.model for w in workers)],
        "served_model_name": [frontend.served_model_names],
        "host": [cluster.host], "port": [cluster.port],
        "prefill": [roles.count(Role.PREFILL) if mode == "disaggregated"
                    else roles.count(Role.COLOCATED) - 1],
        "decode": [roles.count(Role.DECODE) if mode == "disaggregated"
                   else roles.count(Role.COLOCATED) - 1],
        "max_waiting_requests": [frontend.max_waiting_requests],
        "retry_after_s": [frontend.conductor.min_retry_after_s],
        "etcd": [cluster.etcd], "cluster": [cluster.etcd_cluster],
        # what the store master, the frontend and (in their environment) the workers prove
        "secret_file": [launcher.secret, frontend.secret],
        "secret_env": [launcher.secret, frontend.secret],
        # the Conductor's group and the members launched for it (each told the group's size)
        "cpp_nodes": [frontend.conductor.cpp_nodes, roles.count(Role.CPP),
                      *(w.cpp_nodes for w in workers if w.role is Role.CPP)],
        "cpp_min_tokens": [frontend.conductor.cpp_min_tokens],
        "cpp_chunk_tokens": [frontend.conductor.cpp_chunk_tokens,
                             *(w.cpp_chunk_tokens for w in workers if w.role is Role.CPP)],
    }
    return seen[name]


def test_every_setting_is_walked() -> None:
    names = [name for section in SECTIONS for name in section.model_fields]
    assert sorted(names) == sorted(VALUES), "give each new setting a value in VALUES"
    assert len(set(names)) == len(names), "a setting is declared in two sections"


def test_engine_settings_mirror_engine_config() -> None:
    """A field added to EngineConfig without a setting would never reach a worker's engine."""
    engine = {f.name for f in dataclasses.fields(EngineConfig)} - {"extra"}
    assert set(EngineSettings.model_fields) == engine
    assert EngineSettings().to_config() == EngineConfig()


def test_worker_settings_are_worker_spec_keys_and_worker_config_fields() -> None:
    from kvcake.server.cluster.config import WorkerSpec
    spec = {f.name for f in dataclasses.fields(WorkerSpec)}
    config = {f.name for f in dataclasses.fields(WorkerConfig)}
    assert set(WorkerSettings.model_fields) <= spec & config


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize(("section", "name"), WALKED, ids=[n for _, n in WALKED])
def test_every_serve_flag_reaches_its_user_in_every_mode(section: type, name: str,
                                                         mode: str) -> None:
    args = _parse(["--mode", mode, *_argv(section, name)])
    if name == "config":  # a file describes its own cluster and mode
        assert config_from_args(args) == ClusterConfig.from_toml(EXAMPLE)
        return
    if mode not in modes_of(section, name):
        flags = "|".join([flag_name(section, name), *COMPANIONS.get(name, [])[:1]])
        with pytest.raises(ValueError, match=f"^({flags}): applies only to"):
            settings_from_args(args)
        return
    seen = _observed(name, mode, args)
    assert seen and all(v == VALUES[name][1] for v in seen), (name, mode, seen)
    # and not by accident: without the flag, the same parts see something else
    assert _observed(name, mode, _parse(["--mode", mode])) != seen


@pytest.mark.parametrize(("section", "name"), [(s, n) for s, n in WALKED
                                               if s is not ServeSettings])
def test_worker_and_engine_flags_with_a_config_file_are_errors(section: type,
                                                               name: str) -> None:
    args = _parse(["--config", str(EXAMPLE), *_argv(section, name)])
    with pytest.raises(ValueError, match=f"^{flag_name(section, name)}: with --config, set"):
        config_from_args(args)


def test_positional_model_and_the_flag() -> None:
    assert settings_from_args(_parse(["small"]))[0].model == "small"
    assert settings_from_args(_parse(["small", "--model", "small"]))[0].model == "small"
    with pytest.raises(ValueError, match="^--model: given twice"):
        settings_from_args(_parse(["small", "--model", "tiny"]))


def test_a_file_keeps_the_frontend_flags() -> None:
    args = _parse(["--config", str(EXAMPLE), "--max-waiting-requests", "4",
                   "--served-model-name", "x"])
    config = config_from_args(args)
    assert (config.max_waiting_requests, config.served_model_names) == (4, ("x",))


def test_worker_argv_round_trips_every_worker_config_field() -> None:
    config = WorkerConfig(role=Role.DECODE, model="small", host="127.0.0.3", port=4321,
                          log_level="debug", kv_events_endpoint="tcp://127.0.0.1:*",
                          metrics_port=0,
                          worker_id="d-9", master="127.0.0.1:9", store_dram_bytes=3 * 2**20,
                          num_threads=2, layerwise=False, shared_memory=False,
                          engine=EngineConfig(block_size=8, num_blocks=12, max_model_len=100,
                                              enable_prefix_caching=False, attention="gather",
                                              linear_backend="aten", seed=3, dtype="bfloat16"))
    parser = argparse.ArgumentParser()
    worker_cli.register(parser.add_subparsers())
    argv = worker_argv(config, parent_pid=None)
    assert worker_cli.worker_config_from_args(parser.parse_args(argv[argv.index("worker"):])) \
        == config


def test_launched_workers_log_at_the_frontends_level() -> None:
    import logging

    root, cluster_config = logging.getLogger(), ClusterConfig.simple(1, 1)
    old = root.level
    try:
        for level in (logging.WARNING, logging.DEBUG):
            root.setLevel(level)
            config = Cluster(cluster_config).worker_config("w0", cluster_config.workers[0])
            assert config.log_level == logging.getLevelName(level).lower()
    finally:
        root.setLevel(old)


def test_secret_flags_win_over_a_files_security_section_and_exclude_each_other() -> None:
    config = config_from_args(_parse(["--config", str(EXAMPLE), "--secret-env", SECRET_ENV]))
    assert (config.secret_file, config.secret_env) == (None, SECRET_ENV)
    assert Cluster(config).secret == SECRET
    with pytest.raises(ValueError, match="^--secret-file / --secret-env: give one"):
        settings_from_args(_parse(["--secret-file", SECRET_FILE, "--secret-env", SECRET_ENV]))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_serve_hands_the_http_limits_to_the_app_in_every_mode(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcake.server.cluster.launcher as launcher

    handed: list[object] = []
    monkeypatch.setattr(launcher, "serve_disaggregated",
                        lambda config, api_key=None, limits=None: handed.append(limits) or 0)
    monkeypatch.setattr(serve_cli, "_serve_single",
                        lambda settings, config, api_key=None, limits=None:
                        handed.append(limits) or 0)
    args = _parse(["--mode", mode, "--max-request-bytes", "2KiB", "--max-json-depth", "5",
                   "--max-prompt-chars", "300"])
    assert serve_cli.serve(args) == 0
    assert [(lim.max_request_bytes, lim.max_json_depth, lim.max_prompt_chars)  # type: ignore
             for lim in handed] == [(2048, 5, 300)]


def test_a_bad_http_limit_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_json_depth: must be >= 2"):
        http_limits(settings_from_args(_parse(["--max-json-depth", "1"]))[0])


def test_a_bad_switch_interval_is_a_clear_error() -> None:
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="^--switch-interval-ms must be > 0"):
            switch_interval_s(settings_from_args(_parse(["--mode", "single",
                                                         "--switch-interval-ms", bad]))[0])

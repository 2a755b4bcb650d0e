"""Cluster descriptions: `--prefill N --decode M` and TOML files, with errors that name the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvcake.conductor import Policy
from kvcake.server.cli import worker as worker_cli
from kvcake.server.cluster.config import ClusterConfig, WorkerSpec
from kvcake.server.cluster.launcher import worker_argv
from kvcake.server.worker.config import Role, WorkerConfig

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "cluster.example.toml"


def test_the_documented_example_parses() -> None:
    config = ClusterConfig.from_toml(EXAMPLE)
    assert [w.role for w in config.workers] == [Role.PREFILL, Role.PREFILL, Role.DECODE]
    assert config.workers[0].store_dram_bytes == 128 * 2**20
    assert config.engine.kv_cache_bytes == 64 * 2**20
    assert config.engine.max_num_batched_tokens == 512
    assert (config.port, config.master_port) == (24080, 24081)
    assert config.conductor.tbt_slo_s == 0.3


def test_simple_builds_the_pools() -> None:
    config = ClusterConfig.simple(2, 3)
    assert [w.role for w in config.workers] == [Role.PREFILL] * 2 + [Role.DECODE] * 3
    colocated = ClusterConfig.simple(2, 0, mode="colocated")
    assert [w.role for w in colocated.workers] == [Role.COLOCATED] * 2
    assert colocated.conductor.policy is Policy.COLOCATED


@pytest.mark.parametrize(("text", "error"), [
    ('model = "tiny"\nbogus = 1\n', r"unknown keys \['bogus'\]"),
    ('[frontend]\nhots = "x"\n', r"\[frontend\]: unknown keys \['hots'\]"),
    ('[[workers]]\nrole = "prefill"\nrolee = 1\n', r"\[\[workers\]\]: unknown keys"),
    ('[[workers]]\nrole = "prefill"\n', "at least one prefill and one decode"),
    ('[[workers]]\nrole = "mixer"\n', "workers.role: must be prefill, decode or colocated"),
    ('[[workers]]\nrole = "decode"\nlaunch = false\n', "launch = false needs its port"),
    ('[engine]\nkv_cache_bytes = "lots"\n', "kv_cache_bytes: cannot read 'lots'"),
    ('[conductor]\npolicy = "best"\n', "policy must be one of"),
    ('[conductor]\ncpp_min_tokens = 4096\n', "not served live yet"),
    ('mode = "hybrid"\n', "mode: must be disaggregated or colocated"),
    ("model = \n", "not valid TOML"),
])
def test_bad_files_name_what_to_change(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        ClusterConfig.from_toml(path)


def test_simple_needs_both_roles() -> None:
    with pytest.raises(ValueError, match="need at least 1 of each, got 1 and 0"):
        ClusterConfig.simple(1, 0)
    with pytest.raises(ValueError, match="mode colocated needs only colocated workers"):
        ClusterConfig(mode="colocated", workers=(WorkerSpec(Role.PREFILL),))


def test_serve_arguments_become_a_cluster() -> None:
    from kvcake.cli import build_parser
    from kvcake.server.cli.serve import config_from_args

    args = build_parser().parse_args(["serve", "--kv-cache-bytes", "8MiB", "--port", "24050"])
    args.mode, args.prefill, args.decode = "disaggregated", 2, 1
    config = config_from_args(args)
    assert [w.role for w in config.workers] == [Role.PREFILL, Role.PREFILL, Role.DECODE]
    assert (config.engine.kv_cache_bytes, config.port) == (8 * 2**20, 24050)
    assert [w.num_threads for w in config.workers] == [1, 1, 1]  # WorkerSpec's default
    args.num_threads = 2
    assert [w.num_threads for w in config_from_args(args).workers] == [2, 2, 2]
    args.mode = "colocated"  # as many workers as --prefill + --decode
    assert [w.num_threads for w in config_from_args(args).workers] == [2, 2, 2]
    args.config = str(EXAMPLE)
    with pytest.raises(ValueError, match=r"^--num-threads: with --config, set num_threads"):
        config_from_args(args)
    args.num_threads = None
    with pytest.raises(ValueError, match=r"^--kv-cache-bytes: with --config, set"):
        config_from_args(args)  # never silently ignored
    args.kv_cache_bytes = None
    assert config_from_args(args) == ClusterConfig.from_toml(EXAMPLE)


def test_shared_memory_can_be_turned_off_from_the_file_to_the_worker_process() -> None:
    config = ClusterConfig.from_dict({"workers": [{"role": "prefill"},
                                                  {"role": "decode", "shared_memory": False}]})
    assert [w.shared_memory for w in config.workers] == [True, False]
    argv = worker_argv(WorkerConfig(role=Role.DECODE, shared_memory=False), None)
    assert "--no-shared-memory" in argv
    assert "--no-shared-memory" not in worker_argv(WorkerConfig(role=Role.DECODE), None)
    parser = argparse.ArgumentParser()
    worker_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv[argv.index("worker"):])
    assert args.shared_memory is False

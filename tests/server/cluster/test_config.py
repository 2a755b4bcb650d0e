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


_PD = '[[workers]]\nrole = "prefill"\n[[workers]]\nrole = "decode"\n'


@pytest.mark.parametrize(("text", "error"), [
    ('model = "tiny"\nbogus = 1\n', r"unknown keys \['bogus'\]"),
    ('[frontend]\nhots = "x"\n', r"\[frontend\]: unknown keys \['hots'\]"),
    ('[[workers]]\nrole = "prefill"\nrolee = 1\n', r"\[\[workers\]\]: unknown keys"),
    ('[[workers]]\nrole = "prefill"\n', "at least one prefill and one decode"),
    ('[[workers]]\nrole = "mixer"\n', "workers.role: must be prefill, decode, colocated or cpp"),
    ('[[workers]]\nrole = "decode"\nlaunch = false\n', "launch = false needs its port"),
    ('[engine]\nkv_cache_bytes = "lots"\n', "kv_cache_bytes: cannot read 'lots'"),
    ('[conductor]\npolicy = "best"\n', "policy must be one of"),
    (_PD + '[conductor]\ncpp_min_tokens = 4096\n', "needs cpp_nodes = 2 workers of role cpp"),
    (_PD + '[[workers]]\nrole = "cpp"\ncount = 2\n', "set \\[conductor\\] cpp_min_tokens"),
    (_PD + '[conductor]\ncpp_min_tokens = 4096\n[[workers]]\nrole = "cpp"\ncount = 3\n',
     "needs cpp_nodes = 2 workers of role cpp .* this cluster has 3"),
    (_PD + '[conductor]\ncpp_min_tokens = 4096\ncpp_nodes = 5\n[[workers]]\nrole = "cpp"\n'
     'count = 5\n', "cpp_nodes / --cpp-nodes: 5 stages for a 4-layer model; use 2..4"),
    (_PD + '[conductor]\ncpp_min_tokens = 4096\ncpp_nodes = 1\n', "cpp_nodes must be >= 2"),
    (_PD + '[conductor]\ncpp_min_tokens = 4096\ncpp_chunk_tokens = 64\n',
     "cpp_chunk_tokens must be >= 1000"),
    (_PD + '[conductor]\ncpp_min_tokens = 9\n[[workers]]\nrole = "cpp"\ncount = 2\n'
     '[etcd]\nendpoints = ["127.0.0.1:2379"]\n', "does not join through etcd yet"),
    ('mode = "colocated"\n[[workers]]\nrole = "colocated"\n[conductor]\ncpp_min_tokens = 9\n',
     "needs mode disaggregated"),
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


def test_cpp_group_from_a_file(tmp_path: Path) -> None:
    """Dedicated members beside the plain prefill workers; a small chunk floor for tiny models."""
    path = tmp_path / "cluster.toml"
    path.write_text(_PD + '[conductor]\ncpp_min_tokens = 200\ncpp_chunk_tokens = 48\n'
                    'cpp_min_chunk_tokens = 16\n[[workers]]\nrole = "cpp"\ncount = 2\n')
    config = ClusterConfig.from_toml(path)
    assert [w.role for w in config.workers] == [Role.PREFILL, Role.DECODE, Role.CPP, Role.CPP]
    assert (config.conductor.cpp_min_tokens, config.conductor.cpp_chunk_tokens) == (200, 48)


def test_cpp_serve_flags() -> None:
    from kvcake.cli import build_parser
    from kvcake.server.cli.serve import config_from_args

    def parse(*flags: str) -> ClusterConfig:
        return config_from_args(build_parser().parse_args(["serve", *flags]))

    config = parse("--prefill", "1", "--decode", "1", "--cpp-nodes", "2", "--cpp-min-tokens",
                   "4096")
    assert [w.role for w in config.workers] == [Role.PREFILL, Role.DECODE, Role.CPP, Role.CPP]
    assert (config.conductor.cpp_nodes, config.conductor.cpp_min_tokens,
            config.conductor.cpp_chunk_tokens) == (2, 4096, 1024)
    assert parse("--cpp-nodes", "3", "--cpp-min-tokens", "9", "--cpp-chunk-tokens",
                 "2000").conductor.cpp_chunk_tokens == 2000
    alone = parse("--cpp-nodes", "3").conductor  # X chunks and more go to the group
    assert (alone.cpp_nodes, alone.cpp_min_tokens) == (3, 3 * 1024)
    assert parse("--cpp-min-tokens", "5000").conductor.cpp_nodes == 2
    for flags, error in [
            (["--cpp-chunk-tokens", "2000"], "give --cpp-nodes X"),
            (["--cpp-nodes", "1", "--cpp-min-tokens", "9"], "--cpp-nodes: a CPP group pipelines "
             "over >= 2 workers, got 1"),
            (["--cpp-nodes", "2", "--cpp-min-tokens", "9", "--cpp-chunk-tokens", "100"],
             "cpp_chunk_tokens must be >= 1000"),
            (["--cpp-nodes", "2", "--cpp-min-tokens", "0"], "cpp_min_tokens must be >= 1"),
            (["--cpp-nodes", "8", "--cpp-min-tokens", "9"], "8 stages for a 4-layer model"),
            (["--mode", "colocated", "--cpp-nodes", "2", "--cpp-min-tokens", "9"],
             "applies only to --mode disaggregated"),
            (["--config", "x.toml", "--cpp-nodes", "2", "--cpp-min-tokens", "9"],
             "set \\[conductor\\] cpp_min_tokens, cpp_nodes"),
    ]:
        with pytest.raises(ValueError, match=error):
            parse(*flags)

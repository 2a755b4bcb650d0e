"""`kvcake store master|node` as real processes: start, serve, SIGTERM, nothing lost elsewhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcake.store import StoreClient
from kvcake.transfer import TransferConfig

KVCAKE = [sys.executable, "-m", "kvcake"]
STORE = [sys.executable, "-m", "kvcake.store"]  # the same subcommands, without torch imports


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*STORE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen[str], pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
    """Read the process's log until `pattern` shows up (process start-up, not event order)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"{pattern!r} not in output: {''.join(seen)}")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_master_and_nodes_serve_and_stop_on_sigterm(
        procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    master = _spawn("master", "--port", "0", "--no-node", "--strategy", "local_first")
    procs.append(master)
    address = _wait_for(master, r"master listening on (\S+)").group(1)
    nodes = []
    for name in ("a", "b"):
        node = _spawn("node", "--master", address, "--dram", "8MiB", "--node-id", name,
                      "--rails", "1", "--disk", str(tmp_path / name), "--disk-size", "16MiB")
        procs.append(node)
        _wait_for(node, f"node {name} joined")
        nodes.append(node)
    tcp = TransferConfig(serve=False, use_shared_memory=False, num_rails=1)
    with StoreClient(address, transfer_config=tcp, local_node="a") as on_a, \
            StoreClient(address, transfer_config=tcp, local_node="b") as on_b:
        data_a, data_b = os.urandom(200_000), os.urandom(300_000)
        on_a.put("on-a", data_a)
        on_b.put("on-b", data_b)
        assert on_a.stats()["num_nodes"] == 2
        nodes[0].send_signal(signal.SIGTERM)
        assert nodes[0].wait(timeout=30) == 0
        _wait_for(master, r"node a (left|closed)")
        assert on_b.get("on-b") == data_b  # the other node's objects are intact
        with pytest.raises(KeyError):
            on_b.get("on-a")
    nodes[1].send_signal(signal.SIGTERM)
    assert nodes[1].wait(timeout=30) == 0
    master.send_signal(signal.SIGTERM)
    assert master.wait(timeout=30) == 0


def test_node_with_bad_arguments_exits_2() -> None:
    done = subprocess.run([*KVCAKE, "store", "node", "--master", "127.0.0.1:1", "--dram",
                           "lots"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--dram" in done.stderr
    done = subprocess.run([*STORE, "node", "--master", "127.0.0.1:1", "--dram", "1MiB"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--master" in done.stderr


def test_a_master_with_a_secret_admits_only_nodes_and_clients_that_hold_it(
        procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    from kvcake.auth import ClusterSecret

    secret = ClusterSecret.generate()
    secret_file = tmp_path / "secret"
    secret.write(secret_file)
    master = _spawn("master", "--port", "0", "--no-node", "--secret-file", str(secret_file))
    procs.append(master)
    address = _wait_for(master, r"master listening on (\S+)").group(1)
    env = {**os.environ, "MY_CLUSTER_SECRET": secret.text()}
    node = subprocess.Popen([*STORE, "node", "--master", address, "--dram", "4MiB", "--node-id",
                             "a", "--rails", "1", "--secret-env", "MY_CLUSTER_SECRET"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    procs.append(node)
    _wait_for(node, "node a joined")
    stranger = subprocess.run([*STORE, "node", "--master", address, "--dram", "1MiB"],
                              capture_output=True, text=True, timeout=60)
    assert stranger.returncode == 2 and "requires the cluster secret" in stranger.stderr
    tcp = TransferConfig(serve=False, use_shared_memory=False, num_rails=1, secret=secret)
    with StoreClient(address, transfer_config=tcp) as client:
        client.put("k", b"x" * 5000)
        assert client.get("k") == b"x" * 5000 and client.stats()["num_nodes"] == 1
    secret_file.chmod(0o644)
    loose = subprocess.run([*STORE, "master", "--port", "0", "--secret-file", str(secret_file)],
                           capture_output=True, text=True, timeout=60)
    assert loose.returncode == 2 and "chmod 600" in loose.stderr
    for proc in (node, master):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("argv, prefault", [
    (["node", "--master", "127.0.0.1:1", "--dram", "1MiB"], True),
    (["node", "--master", "127.0.0.1:1", "--dram", "1MiB", "--no-prefault"], False),
    (["master", "--port", "1"], True),  # the node a master hosts by default
    (["master", "--port", "1", "--with-node", "1MiB"], True),
    (["master", "--port", "1", "--with-node", "1MiB", "--no-prefault"], False),
])
def test_a_dedicated_node_prefaults_its_segment_unless_told_not_to(
        argv: list[str], prefault: bool) -> None:
    import argparse

    from kvcake.store.cli import register
    from kvcake.store.config import NodeConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["store", *argv]).prefault is prefault
    assert NodeConfig(1 << 20).prefault is False  # a worker's or an embedded store's node


def _master_args(argv: list[str]) -> object:
    import argparse

    from kvcake.store.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["store", "master", "--port", "1", *argv])


@pytest.mark.parametrize("argv, dram", [
    ([], 1 << 30),  # the default deployment: the master hosts a 1 GiB node (Redis-like)
    (["--with-node", "16MiB"], 16 << 20),
    (["--no-node"], None),  # metadata only, as mooncake_master
    (["--etcd", "127.0.0.1:1"], None),  # an elected master hosts no node
])
def test_a_master_hosts_a_node_by_default(argv: list[str], dram: int | None) -> None:
    from kvcake.store.cli import DEFAULT_HOSTED_DRAM, hosted_node_dram

    assert DEFAULT_HOSTED_DRAM == "1GiB"
    assert hosted_node_dram(_master_args(argv)) == dram  # type: ignore[arg-type]


@pytest.mark.parametrize("argv, says", [
    (["--with-node", "1MiB", "--no-node"], "give one"),
    (["--with-node", "1MiB", "--etcd", "127.0.0.1:1"], "--etcd"),
    (["--with-node", "lots"], "--with-node"),
])
def test_contradictory_node_flags_are_refused(argv: list[str], says: str) -> None:
    from kvcake.store.cli import hosted_node_dram

    with pytest.raises(ValueError, match=says):
        hosted_node_dram(_master_args(argv))  # type: ignore[arg-type]


def test_the_default_master_stores_by_itself_and_dedicated_nodes_join_it(
        procs: list[subprocess.Popen[str]]) -> None:
    master = _spawn("master", "--port", "0", "--no-prefault")  # the default node, not faulted in
    procs.append(master)
    address = _wait_for(master, r"master listening on (\S+) \(hosting node").group(1)
    tcp = TransferConfig(serve=False, use_shared_memory=False, num_rails=1)
    with StoreClient(address, transfer_config=tcp) as client:
        stats = client.stats()
        assert stats["num_nodes"] == 1 and stats["hosted_node"]
        assert client.put("one", b"1" * 70_000)  # one request to the hosting master
        assert client.get("one") == b"1" * 70_000
        node = _spawn("node", "--master", address, "--dram", "8MiB", "--node-id", "extra",
                      "--rails", "1")
        procs.append(node)
        _wait_for(node, "node extra joined")
        assert client.stats()["num_nodes"] == 2
        assert client.get("one") == b"1" * 70_000
    for proc in (node, master):
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert code == 0, (code, proc.stdout.read() if proc.stdout else "")

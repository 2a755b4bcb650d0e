"""`kvcake worker`'s cluster secret: from --secret-file / --secret-env, else from the variable
`kvcake serve` sets for its children, else none; never from the command line itself; the
launcher hands it over in the environment, never in the argv."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.server.cli.worker import worker_secret
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster, worker_argv

TEXT = "a-cluster-secret-of-enough-length"


def _args(file: str | None = None, env: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(secret_file=file, secret_env=env)


def test_sources_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    assert worker_secret(_args()) is None
    monkeypatch.setenv(auth.ENV_VAR, TEXT)
    assert worker_secret(_args()) == ClusterSecret(TEXT.encode())
    monkeypatch.setenv("MY_SECRET", "another-secret-of-enough-length")
    assert worker_secret(_args(env="MY_SECRET")) == ClusterSecret(
        b"another-secret-of-enough-length")
    path = tmp_path / "cluster.secret"
    ClusterSecret(b"file-secret-of-enough-length").write(path)
    assert worker_secret(_args(file=str(path))) == ClusterSecret(b"file-secret-of-enough-length")


def test_bad_sources_say_what_to_change(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("UNSET_SECRET", raising=False)
    with pytest.raises(ValueError, match="--secret-file/--secret-env: .*UNSET_SECRET is not set"):
        worker_secret(_args(env="UNSET_SECRET"))
    loose = tmp_path / "loose.secret"
    loose.write_text(TEXT)
    os.chmod(loose, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        worker_secret(_args(file=str(loose)))


def test_the_launcher_never_puts_the_secret_on_a_command_line() -> None:
    config = ClusterConfig.simple(1, 1)
    cluster = Cluster(config)
    for i, spec in enumerate(config.workers):
        argv = worker_argv(cluster.worker_config(f"w{i}", spec), parent_pid=None)
        assert cluster.secret.text() not in " ".join(argv)


def test_a_remote_worker_needs_a_named_secret() -> None:
    from kvcake.server.cluster.config import WorkerSpec
    from kvcake.server.worker.config import Role
    workers = (WorkerSpec(Role.PREFILL), WorkerSpec(Role.DECODE, port=24100, launch=False))
    with pytest.raises(ValueError, match=r"\[security\]: a worker with launch = false needs"):
        ClusterConfig(workers=workers)
    assert ClusterConfig(workers=workers, secret_env="X").secret_env == "X"

"""`--bind-threads` of `kvcake serve --mode single`: which CPUs, and the op that binds."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch

from kvcake.engine import cpu_ops
from kvcake.server.frontend.local_backend import (
    LocalBackendConfig,
    bind_engine_threads,
    thread_cpus,
)


def in_own_thread(run: Callable[[], None], seen: dict[str, object]) -> None:
    """Run `run` on a thread of its own (its torch pool and its affinity end with it, so the
    binding leaves this process's threads as they were); skip if it left `seen["skip"]`."""
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "skip" in seen:
        pytest.skip(str(seen["skip"]))


def test_thread_cpus_takes_the_lowest_allowed_cpus_one_per_thread() -> None:
    assert thread_cpus(2, {3, 1, 7}) == [1, 3]
    assert thread_cpus(1, {5}) == [5]
    assert thread_cpus(3, {0, 1, 2}) == [0, 1, 2]


def test_thread_cpus_leaves_threads_unbound_when_cpus_are_fewer() -> None:
    assert thread_cpus(2, {0}) is None


def test_thread_cpus_rejects_a_pool_without_threads() -> None:
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        thread_cpus(0, {0, 1})


def test_binding_is_off_unless_asked() -> None:
    assert LocalBackendConfig().bind_threads is False


def test_bind_threads_pins_the_calling_thread_to_the_first_cpu() -> None:
    if not cpu_ops.load():
        pytest.skip(f"kvcake CPU ops not built: {cpu_ops.load_error()}")
    seen: dict[str, object] = {}

    def run() -> None:  # a thread of its own: its pool (and its affinity) end with it
        n = torch.get_num_threads()
        cpus = thread_cpus(n, os.sched_getaffinity(0))
        if cpus is None:
            seen["skip"] = f"{n} torch threads, fewer CPUs"
            return
        seen["cpus"] = cpus
        seen["bound"] = cpu_ops.bind_threads(cpus)
        seen["own"] = os.sched_getaffinity(0)

    in_own_thread(run, seen)
    cpus = seen["cpus"]
    assert isinstance(cpus, list)
    assert seen["bound"] == cpus
    assert seen["own"] == {cpus[0]}


def test_bind_threads_needs_one_cpu_per_thread() -> None:
    if not cpu_ops.load():
        pytest.skip(f"kvcake CPU ops not built: {cpu_ops.load_error()}")
    with pytest.raises(RuntimeError, match="one CPU per intra-op thread"):
        cpu_ops.bind_threads([0] * (torch.get_num_threads() + 1))


def test_serve_binds_the_engine_threads_by_default() -> None:
    """`kvcake serve --mode single` binds (every torch thread of the engine, the engine thread
    included) unless told not to."""
    from kvcake.cli import build_parser
    from kvcake.server.cli.serve import local_config

    def config(*flags: str) -> LocalBackendConfig:
        return local_config(build_parser("serve").parse_args(
            ["serve", "--mode", "single", *flags]))

    default = config()
    assert (default.bind_threads, default.bind_engine_thread) == (True, True)
    assert config("--no-bind-threads").bind_threads is False
    workers_only = config("--no-bind-engine-thread")
    assert (workers_only.bind_threads, workers_only.bind_engine_thread) == (True, False)


def test_workers_only_binding_leaves_the_engine_thread_floating() -> None:
    if not cpu_ops.load():
        pytest.skip(f"kvcake CPU ops not built: {cpu_ops.load_error()}")
    seen: dict[str, object] = {}

    def run() -> None:  # a thread of its own: its pool (and its affinity) end with it
        allowed = os.sched_getaffinity(0)
        n = min(2, len(allowed))  # a pool of its own: tests/engine's conftest sets torch to 1
        if n < 2:
            seen["skip"] = f"{len(allowed)} CPU allowed: no worker thread to bind"
            return
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            seen["cpus"] = thread_cpus(n, allowed)
            seen["bound"] = bind_engine_threads(n, engine_thread=False)
            seen["own"], seen["allowed"] = os.sched_getaffinity(0), allowed
        finally:
            torch.set_num_threads(before)

    in_own_thread(run, seen)
    cpus = seen["cpus"]
    assert isinstance(cpus, list)
    assert seen["bound"] == [-1, *cpus[1:]]  # thread 0 floating, the workers on their CPUs
    assert seen["own"] == seen["allowed"]


def test_a_single_thread_is_left_unbound() -> None:
    seen: dict[str, object] = {}

    def run() -> None:
        before = os.sched_getaffinity(0)
        seen["bound"] = bind_engine_threads(1)
        seen["same"] = os.sched_getaffinity(0) == before

    in_own_thread(run, seen)
    assert seen == {"bound": [], "same": True}

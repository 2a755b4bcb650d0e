"""Each launched worker gets CPUs of its own when there are enough, nobody is pinned otherwise,
and the launcher applies the plan to the processes it starts (any role alike)."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from kvcake.server.cluster import launcher as launcher_mod
from kvcake.server.cluster.config import ClusterConfig, WorkerSpec
from kvcake.server.cluster.cpu_pinning import plan_cpus
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.worker.config import Role


def test_each_worker_gets_its_own_cpus_in_order() -> None:
    assert plan_cpus([1, 1], [0, 1]) == [(0,), (1,)]
    assert plan_cpus([2, 1], [7, 3, 5, 4]) == [(3, 4), (5,)]


def test_too_few_cpus_or_unbounded_threads_pin_nobody() -> None:
    assert plan_cpus([1, 1, 1], [0, 1]) is None
    assert plan_cpus([2, 1], [0, 1]) is None
    assert plan_cpus([1, None], [0, 1, 2, 3]) is None
    assert plan_cpus([], [0, 1]) is None
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        plan_cpus([0, 1], [0, 1])


def test_pin_workers_is_read_from_the_config_and_checked() -> None:
    workers = [{"role": "prefill"}, {"role": "decode"}]
    assert ClusterConfig.from_dict({"workers": workers}).pin_workers is True  # the default
    assert ClusterConfig.from_dict({"workers": workers, "pin_workers": False}).pin_workers \
        is False
    with pytest.raises(ValueError, match="pin_workers: must be true or false"):
        ClusterConfig.from_dict({"workers": workers, "pin_workers": "yes"})


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def _launch_all(monkeypatch: pytest.MonkeyPatch, config: ClusterConfig,
                cpus: set[int]) -> dict[int, tuple[int, ...]]:
    pinned: dict[int, tuple[int, ...]] = {}
    pids = iter(range(1000, 1100))
    monkeypatch.setattr(launcher_mod.os, "sched_getaffinity", lambda pid: cpus)
    monkeypatch.setattr(launcher_mod.os, "sched_setaffinity",
                        lambda pid, c: pinned.__setitem__(pid, tuple(c)))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: _Proc(next(pids)))
    cluster = Cluster(config)
    cluster._cpus = cluster._cpu_plan()
    for i, spec in enumerate(config.workers):
        if spec.launch:
            cluster._launch(f"{spec.role.value}-{i}", spec)
    return pinned


@pytest.mark.parametrize("roles", [(Role.PREFILL, Role.DECODE), (Role.COLOCATED, Role.COLOCATED)])
def test_launcher_pins_disagg_and_colocated_workers_alike(monkeypatch: pytest.MonkeyPatch,
                                                          roles: Any) -> None:
    mode = "colocated" if roles[0] is Role.COLOCATED else "disaggregated"
    config = ClusterConfig(mode=mode, workers=tuple(WorkerSpec(r) for r in roles),
                           pin_workers=True)
    assert _launch_all(monkeypatch, config, {0, 1}) == {1000: (0,), 1001: (1,)}
    assert _launch_all(monkeypatch, config, {0}) == {}  # too few: nobody
    default = ClusterConfig(mode=mode, workers=config.workers)  # the default: on
    assert _launch_all(monkeypatch, default, {0, 1}) == {1000: (0,), 1001: (1,)}
    off = ClusterConfig(mode=mode, workers=config.workers, pin_workers=False)
    assert _launch_all(monkeypatch, off, {0, 1}) == {}


def test_this_host_can_pin_a_child() -> None:
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity on this platform")
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.Popen(["sleep", "5"])
    try:
        os.sched_setaffinity(proc.pid, {cpu})
        assert os.sched_getaffinity(proc.pid) == {cpu}
    finally:
        proc.kill()
        proc.wait()

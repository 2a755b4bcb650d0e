"""The cluster file's [etcd] section and `kvcake serve --etcd`: workers may be none (they join
through etcd), bad endpoints are errors naming the setting, and without etcd nothing changes."""

from __future__ import annotations

import pytest

from kvcake.server.cluster.config import ClusterConfig


def test_etcd_section_allows_a_cluster_without_static_workers() -> None:
    config = ClusterConfig.from_dict({"etcd": {"endpoints": ["10.0.0.1:2379", "10.0.0.2:2379"],
                                               "cluster": "blue"}})
    assert config.etcd == "10.0.0.1:2379,10.0.0.2:2379" and config.etcd_cluster == "blue"
    assert config.workers == ()
    assert ClusterConfig.simple(0, 0, etcd_endpoints=("h:1",)).workers == ()


def test_etcd_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"\[etcd\] endpoints / --etcd: expected HOST:PORT"):
        ClusterConfig.from_dict({"etcd": {"endpoints": ["nohost"]}})
    with pytest.raises(ValueError, match=r"unknown"):
        ClusterConfig.from_dict({"etcd": {"endpoint": ["h:1"]}})
    with pytest.raises(ValueError, match=r"\[etcd\]: workers join through etcd in mode "
                                         "disaggregated only"):
        ClusterConfig.simple(1, 0, mode="colocated", etcd_endpoints=("h:1",))


def test_without_etcd_a_cluster_still_needs_both_roles() -> None:
    with pytest.raises(ValueError, match="need at least 1 of each"):
        ClusterConfig.simple(0, 0)
    assert ClusterConfig.simple(1, 1).etcd is None

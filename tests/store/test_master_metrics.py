"""The store master's own /metrics (`kvcake store master --metrics-port`), parsed with
prometheus_client's parser."""

from __future__ import annotations

import httpx

from kvcake.store.cli import _serve_metrics
from kvcake.store.master import MasterService
from tests.server.prom import value


def test_master_metrics_are_served_and_parse() -> None:
    service = MasterService()
    service.register_node("n1", 4096, 0, {})
    http = _serve_metrics(service.stats, "127.0.0.1", 0)
    try:
        text = httpx.get(f"http://127.0.0.1:{http.server_port}/metrics").text
    finally:
        http.shutdown()
        http.server_close()
    assert value(text, "kvcake:store_nodes") == 1
    assert value(text, "kvcake:store_capacity_bytes") == 4096
    assert "kvcake:store_evictions_total 0.0" in text.splitlines()
    assert "kvcake:store_objects 0.0" in text.splitlines()
    assert _serve_metrics(service.stats, "127.0.0.1", None) is None

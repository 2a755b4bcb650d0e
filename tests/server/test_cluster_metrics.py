"""/metrics across a disaggregated cluster, parsed with prometheus_client's parser: the
frontend's (vLLM's names under kvcake:, the cluster view, the in-process store master's) and
each worker's own."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from kvcake.server.cluster.launcher import Cluster
from kvcake.server.frontend.api import ApiServer, create_app
from tests.server.prom import value
from tests.server.test_disagg import cluster_config


def test_frontend_and_worker_metrics(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = cluster_config(tmp_path_factory, 1, 1)
    workers = tuple(dataclasses.replace(w, metrics_port=0) for w in base.workers)
    with Cluster(dataclasses.replace(base, workers=workers), in_process=True) as cluster:
        assert cluster.backend is not None
        with ApiServer(create_app(cluster.backend)) as api:
            body = {"prompt": list(range(1, 50)), "max_tokens": 3, "ignore_eos": True}
            assert httpx.post(api.url + "/v1/completions", json=body).status_code == 200
            text = httpx.get(api.url + "/metrics").text
        assert value(text, "kvcake:request_success_total", finished_reason="length",
                     model_name="tiny") == 1
        assert value(text, "kvcake:time_to_first_token_seconds_count", model_name="tiny") == 1
        assert value(text, "kvcake:prefix_cache_queries_total") == 49
        assert value(text, "kvcake:live_workers", role="prefill") == 1
        assert value(text, "kvcake:live_workers", role="decode") == 1
        assert value(text, "kvcake:conductor_decisions_total", decision="placed") == 1
        assert value(text, "kvcake:store_nodes") == 2  # the store master, in the frontend
        assert value(text, "kvcake:store_capacity_bytes") > 0
        assert "kvcake:kv_stream_hidden_share" in text
        for worker in cluster.workers.values():
            assert worker.metrics_port
            own = httpx.get(f"http://{worker.config.host}:{worker.metrics_port}/metrics").text
            role = worker.config.role.value
            assert value(own, "kvcake:kv_cache_usage_perc", worker_id=worker.worker_id,
                         role=role, model_name="tiny") >= 0
            if role == "prefill":  # the prompt's 3 full blocks entered its prefix cache
                assert value(own, "kvcake:kv_blocks_stored_total") >= 3

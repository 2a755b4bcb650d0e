"""Admission control of the local backend: HTTP 429 with Retry-After, and serving goes on."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvcake.engine.config import EngineConfig
from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.backend import GenerateRequest, Rejected
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig
from kvcake.types import RequestId
from tests.server.prom import value

ENGINE = EngineConfig(kv_cache_bytes=16 * 2**20, max_num_batched_tokens=8)


def test_queue_limit_zero_rejects_with_429_and_keeps_serving() -> None:
    config = LocalBackendConfig(engine=ENGINE, max_waiting_requests=0, retry_after_s=2.5)
    with LocalBackend.from_config(config) as backend, ApiServer(create_app(backend)) as api:
        for _ in range(2):
            reply = httpx.post(api.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert reply.status_code == 429
            assert reply.headers["Retry-After"] == "3"  # whole seconds, rounded up
            error = reply.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "limit 0" in error["message"]
        assert httpx.get(api.url + "/health").status_code == 200
        metrics = httpx.get(api.url + "/metrics").text
        assert value(metrics, "kvcake:request_rejected_total",
                     reason="max_waiting_requests") == 2
        assert value(metrics, "kvcake:http_errors_total", status="429") == 2


def test_queue_limit_one_rejects_while_a_prefill_waits() -> None:
    # A 512-token prompt prefills in 64 chunks of 8 tokens: it waits for its first token far
    # longer than the second request takes to arrive.
    config = LocalBackendConfig(engine=ENGINE, max_waiting_requests=1)

    async def scenario(backend: LocalBackend) -> list[int]:
        long = GenerateRequest(RequestId("long"), tuple([7] * 512), max_tokens=2, ignore_eos=True)
        stream = await backend.generate(long)
        with pytest.raises(Rejected, match="limit 1"):
            await backend.generate(GenerateRequest(RequestId("late"), (1, 2), max_tokens=2))
        tokens = [t async for event in stream for t in event.token_ids]
        after = await backend.generate(GenerateRequest(RequestId("after"), (1, 2), max_tokens=3,
                                                       ignore_eos=True))
        tokens += [t async for event in after for t in event.token_ids]
        return tokens

    with LocalBackend.from_config(config) as backend:
        assert len(asyncio.run(scenario(backend))) == 5
        assert backend.num_live_requests == 0


def test_invalid_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_waiting_requests"):
        LocalBackendConfig(max_waiting_requests=-1)
    with pytest.raises(ValueError, match="retry_after_s"):
        LocalBackendConfig(retry_after_s=0)
    with pytest.raises(ValueError, match="num_threads"):
        LocalBackendConfig(num_threads=0)

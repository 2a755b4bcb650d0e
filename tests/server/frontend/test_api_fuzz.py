"""HTTP fuzzing from the app's own OpenAPI schema (schemathesis, driven by hypothesis): every
operation gets generated (valid and invalid) requests against a real uvicorn server; none may
answer 5xx or drop the connection, every 4xx carries OpenAI's error body, and the server still
serves afterwards. The backend is a fast fake: this fuzzes the HTTP layer, not the engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="pip install -e '.[test]' (schemathesis)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from kvcake.server.frontend.api import ApiServer, create_app  # noqa: E402
from kvcake.server.frontend.backend import (  # noqa: E402
    BackendStats,
    FinishReason,
    GenerateRequest,
    TokenEvent,
)


class _Stream:
    def __init__(self, request: GenerateRequest) -> None:
        self.left = max(1, min(request.max_tokens, 3))

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.left == 0:
            raise StopAsyncIteration
        self.left -= 1
        return TokenEvent((66,), finish_reason=FinishReason.LENGTH if self.left == 0 else None)

    async def aclose(self) -> None:
        pass


class QuickBackend:
    model_name, max_model_len, vocab_size = "quick", 256, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))[:200] or [0]

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t % 128 for t in token_ids).decode("ascii")

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.encode("".join(f"{role}:{content}" for role, content in messages))

    async def generate(self, request: GenerateRequest) -> _Stream:
        return _Stream(request)

    def stats(self) -> BackendStats:
        return BackendStats()


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    with ApiServer(create_app(QuickBackend())) as api:
        yield api


@pytest.fixture(scope="module")
def operations(server: ApiServer) -> list[Any]:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_describes_every_route_and_its_body(server: ApiServer) -> None:
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert set(paths) == {"/health", "/v1/models", "/metrics", "/v1/completions",
                          "/v1/chat/completions", "/tokenize", "/detokenize", "/version"}
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "messages" in body["schema"]["properties"]
    assert "$ref" not in str(body)  # inlined: a client needs no $defs


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_5xx_and_no_dropped_connection(operations: list[Any], mode: str) -> None:
    """Every operation, with requests that follow the schema and requests that break it."""
    labels = []
    for operation in operations:
        if mode == "negative" and operation.method.upper() == "GET":
            continue  # no parameters and no body: nothing to break
        labels.append(operation.label)

        @given(case=operation.as_strategy(GenerationMode(mode)))
        @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            response = case.call(timeout=30)  # a dropped connection raises here
            assert response.status_code < 500, (case.as_curl_command(), response.text[:300])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"]

        check()
    assert sorted(labels) == sorted((["GET /health", "GET /metrics", "GET /v1/models",
                                      "GET /version"] if mode == "positive" else []) + [
        "POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize",
        "POST /detokenize"])


def test_the_server_serves_after_the_fuzzing(server: ApiServer) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "BB"

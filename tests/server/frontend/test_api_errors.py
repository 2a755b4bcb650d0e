"""Error paths of the API: unknown routes, and a backend that fails mid-generation.

`FaultyBackend` is a complete (if tiny) implementation of the Backend contract that emits one
token and then raises, the way a crashed decode worker would: the API must answer 500 (or end
an SSE stream with an error event) and keep serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import httpx
import pytest

from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.backend import BackendStats, FinishReason, GenerateRequest, TokenEvent
from tests.server.prom import value


class _Stream:
    def __init__(self, request: GenerateRequest) -> None:
        self.fail = request.prompt_token_ids[0] == 13  # prompt [13, ...] breaks after 1 token
        self.sent = 0

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> TokenEvent:
        self.sent += 1
        if self.sent == 1:
            return TokenEvent((65,))
        if self.sent == 2:
            if self.fail:
                raise RuntimeError("decode worker lost")
            return TokenEvent((66,), finish_reason=FinishReason.LENGTH)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


class FaultyBackend:
    model_name, max_model_len, vocab_size = "faulty", 64, 100

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.encode("".join(content for _role, content in messages))

    async def generate(self, request: GenerateRequest) -> _Stream:
        if request.prompt_token_ids[0] == 14:
            raise RuntimeError("no worker reachable")
        if request.prompt_token_ids[0] == 15:
            raise ValueError("prompt: this backend cannot serve prompts starting with 15")
        return _Stream(request)

    def stats(self) -> BackendStats:
        return BackendStats()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with ApiServer(create_app(FaultyBackend())) as api:
        yield api.url


def test_unknown_route_and_method_get_openai_errors(url: str) -> None:
    missing = httpx.get(url + "/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(url + "/v1/completions")
    assert wrong.status_code == 405
    assert wrong.json()["error"] == {"message": "Method Not Allowed",
                                     "type": "invalid_request_error", "param": None, "code": None}


def test_failure_at_admission(url: str) -> None:
    broken = httpx.post(url + "/v1/completions", json={"prompt": [14], "max_tokens": 2})
    assert broken.status_code == 500
    assert "no worker reachable" in broken.json()["error"]["message"]
    refused = httpx.post(url + "/v1/completions", json={"prompt": [15], "max_tokens": 2})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "prompt: this backend cannot serve prompts starting with 15")
    assert httpx.post(url + "/v1/completions", json={"prompt": [1]}).status_code == 200


def errors_500(url: str) -> int:
    return int(value(httpx.get(url + "/metrics").text, "kvcake:http_errors_total",
                     status="500"))


def test_failure_mid_generation(url: str) -> None:
    before = errors_500(url)
    whole = httpx.post(url + "/v1/completions", json={"prompt": [13, 1], "max_tokens": 2})
    assert whole.status_code == 500
    assert "decode worker lost" in whole.json()["error"]["message"]
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": [13, 1], "max_tokens": 2, "stream": True}) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "A"
    assert "decode worker lost" in json.loads(events[-1])["error"]["message"]
    assert "[DONE]" not in events
    good = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert good.json()["choices"][0]["text"] == "AB"
    assert errors_500(url) == before + 2

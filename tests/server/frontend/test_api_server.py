"""The OpenAI API end to end: a real server (tiny preset, LocalBackend) on 127.0.0.1, driven by
the official `openai` client, httpx and curl."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from kvcake import LLM, SamplingParams
from kvcake.engine.config import EngineConfig
from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig
from kvcake.server.frontend.protocol import render_chat_text
from tests.server.checks import check_curl_stream, check_min_tokens_masks_stop_ids
from tests.server.prom import value

ENGINE = EngineConfig(kv_cache_bytes=16 * 2**20)


class Running:
    def __init__(self, config: LocalBackendConfig) -> None:
        self.backend = LocalBackend.from_config(config)
        self.backend.start()
        self.api = ApiServer(create_app(self.backend))
        self.api.start()
        self.url = self.api.url

    def close(self) -> None:
        self.api.close()
        self.backend.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    running = Running(LocalBackendConfig(engine=ENGINE))
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def random_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def wait_until(condition: object, timeout_s: float = 20.0) -> None:
    """Polls a cross-thread condition (the engine thread acts asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_models_and_health(server: Running) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 2048
    assert models["data"][0]["vocab_size"] == 512
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_openai_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 5)  # BOS + 5 bytes
    assert out.usage.total_tokens == 11


def test_openai_completion_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=7,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 7  # one event per decode step
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == 3


def test_openai_chat(client: openai.OpenAI, server: Running) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected_prompt = 1 + len(render_chat_text([("system", "be brief"), ("user", "hi")]))
    out = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                         max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.prompt_tokens == expected_prompt
    assert out.usage.completion_tokens == 4
    stream = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == out.choices[0].message.content  # greedy: same reply both ways


def test_greedy_tokens_equal_offline_llm(server: Running) -> None:
    prompts = [random_ids(seed, n) for seed, n in ((1, 37), (2, 5), (3, 90), (4, 16))]
    offline = LLM("tiny", config=ENGINE).generate(
        [[*p] for p in prompts], SamplingParams(max_tokens=12, ignore_eos=True))

    async def through_api() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            replies = await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}) for p in prompts))  # concurrent: one batch
        return [r.json()["choices"][0]["token_ids"] for r in replies]

    assert asyncio.run(through_api()) == [o.token_ids for o in offline]
    text = LLM("tiny", config=ENGINE).generate("The cat", SamplingParams(max_tokens=6))[0]
    reply = httpx.post(server.url + "/v1/completions", json={
        "prompt": "The cat", "max_tokens": 6, "temperature": 0, "return_token_ids": True}).json()
    assert reply["choices"][0]["token_ids"] == text.token_ids


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = random_ids(99, 300)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 288  # 18 full blocks of 16


BAD_COMPLETIONS: list[tuple[str, bytes | dict[str, object], int, str]] = [
    ("negative max_tokens", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("string max_tokens", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("malformed JSON", b'{"prompt": "a", ', 400, "not valid JSON"),
    ("JSON array", b"[1, 2]", 400, "JSON object"),
    ("unknown field", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ("missing prompt", {"max_tokens": 3}, 400, "prompt"),
    ("token id over vocab", {"prompt": [1, 512]}, 400, "512"),
    ("negative token id", {"prompt": [-3]}, 400, "-3"),
    ("over-long", {"prompt": [1] * 2000, "max_tokens": 100}, 400, "maximum model length"),
    ("prompt fills context", {"prompt": [1] * 2048}, 400, "no room"),
    ("n above 16", {"prompt": "a", "n": 17}, 400, "n: must be an integer in [1, 16]"),
    ("prompt_logprobs (vLLM's)", {"prompt": "a", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("logprobs above 20", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("best_of above 1", {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("include_stop_str_in_output", {"prompt": "a", "include_stop_str_in_output": True}, 400,
     "include_stop_str_in_output"),
    ("negative temperature", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("empty token list", {"prompt": []}, 400, "prompt"),
    ("two prompts", {"prompt": ["a", "b"]}, 400, "one per request"),
    ("stream_options w/o stream", {"prompt": "a", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("stop id over vocab", {"prompt": "a", "stop_token_ids": [600]}, 400, "stop_token_ids"),
    ("min_tokens > max_tokens", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens"),
    ("unknown model", {"prompt": "a", "model": "gpt-9"}, 404, "gpt-9"),
]


@pytest.mark.parametrize(("name", "body", "status", "needle"), BAD_COMPLETIONS,
                         ids=[case[0] for case in BAD_COMPLETIONS])
def test_bad_completion_is_4xx_and_server_keeps_serving(
        server: Running, name: str, body: bytes | dict[str, object], status: int,
        needle: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(server.url + "/v1/completions", content=raw,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert needle in error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")
    good = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert good.status_code == 200
    assert good.json()["usage"]["completion_tokens"] >= 1


BAD_CHATS: list[tuple[str, dict[str, object], str]] = [
    ("no messages", {"messages": []}, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("tools", {"messages": [{"role": "user", "content": "x"}],
               "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("json output", {"messages": [{"role": "user", "content": "x"}],
                     "response_format": {"type": "json_object"}}, "response_format"),
    ("top_logprobs alone", {"messages": [{"role": "user", "content": "x"}],
                            "top_logprobs": 2}, "top_logprobs"),
    ("negative max_completion_tokens",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2},
     "max_completion_tokens"),
]


@pytest.mark.parametrize(("name", "body", "needle"), BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_is_400(server: Running, name: str, body: dict[str, object],
                         needle: str) -> None:
    reply = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="a", max_tokens=-5)


def test_stream_disconnect_aborts_in_engine(server: Running) -> None:
    before = _metric(server, "kvcake:request_success_total", finished_reason="abort")
    body = {"prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    # The connection is closed now; the engine must drop the request long before 1500 tokens.
    wait_until(lambda: _metric(server, "kvcake:request_success_total", finished_reason="abort")
               == before + 1)
    wait_until(lambda: server.backend.num_live_requests == 0)


def test_nonstream_disconnect_aborts_in_engine(server: Running) -> None:
    before = _metric(server, "kvcake:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.3),
                   json={"prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": True})
    wait_until(lambda: _metric(server, "kvcake:request_success_total", finished_reason="abort")
               == before + 1)
    wait_until(lambda: server.backend.num_live_requests == 0)


def test_metrics_exposition(server: Running, client: openai.OpenAI) -> None:
    prompt = random_ids(7, 64)
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE kvcake:time_to_first_token_seconds histogram" in text
    assert _metric(server, "kvcake:time_to_first_token_seconds_count", model_name="tiny") >= 2
    # the in-process engine reports each request's queue and prefill time, within its TTFT
    queued = _metric(server, "kvcake:request_queue_time_seconds_count")
    assert queued >= 2 and queued == _metric(server, "kvcake:request_prefill_time_seconds_count")
    assert 0 < _metric(server, "kvcake:request_prefill_time_seconds_sum") <= \
        _metric(server, "kvcake:time_to_first_token_seconds_sum")
    hits = _metric(server, "kvcake:prefix_cache_hits_total")
    assert hits >= 48  # the repeat hit 3 blocks
    assert hits < _metric(server, "kvcake:prefix_cache_queries_total")
    assert _metric(server, "kvcake:kv_transfer_bytes_total") == 0  # colocated: nothing moves
    assert "kvcake:num_requests_waiting" in text


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_stream(server: Running) -> None:
    chunks = check_curl_stream(server.url)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def _metric(server: Running, name: str, **labels: str) -> float:
    return value(httpx.get(server.url + "/metrics").text, name, **labels)


def test_min_tokens_masks_stop_ids_until_reached(server) -> None:  # type: ignore[no-untyped-def]
    check_min_tokens_masks_stop_ids(server.url)

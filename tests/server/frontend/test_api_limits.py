"""What the API refuses before it spends work: bodies over the size cap (413, declared or
chunked), JSON nested past the depth cap and text prompts over the character cap (400s, before
parsing and tokenizing); the server keeps serving after each."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import httpx
import pytest

from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.limits import PROMPT_CHARS_PER_TOKEN, HttpLimits, json_depth_exceeds
from tests.server.frontend.test_api_errors import FaultyBackend

LIMITS = HttpLimits(max_request_bytes=2000, max_json_depth=8, max_prompt_chars=50)


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize(("text", "limit", "deeper"), [
    (nested(8), 8, False),
    (nested(9), 8, True),
    ('{"a": {"b": [1, {"c": []}]}}', 5, False),  # 5 levels
    ('{"a": {"b": [1, {"c": []}]}}', 4, True),
    ("{[]}", 1, True),  # mixed brackets: one level removed per pass, never two
    ('{"s": "' + "[" * 50 + '"}', 2, False),  # brackets inside a string do not nest
    ('{"s": "a\\"[[[[[[\\"", "t": "]]]"}', 2, False),  # escaped quotes stay inside the string
    ("[" + ",".join(["[]"] * 500) + "]", 2, False),  # wide, not deep
    ("[" * 20, 8, False),  # not JSON: left to the parser, which names the error
])
def test_json_depth_is_measured_without_parsing(text: str, limit: int, deeper: bool) -> None:
    assert json_depth_exceeds(text.encode(), limit) is deeper


def test_limits_are_validated_and_read_from_a_file_section() -> None:
    with pytest.raises(ValueError, match="max_request_bytes: must be >= 1, got 0"):
        HttpLimits(max_request_bytes=0)
    with pytest.raises(ValueError, match="max_json_depth: must be >= 2"):
        HttpLimits(max_json_depth=1)
    with pytest.raises(ValueError, match="max_prompt_chars: must be >= 1, got 0"):
        HttpLimits(max_prompt_chars=0)
    assert HttpLimits.from_dict({"max_request_bytes": "1MiB", "max_json_depth": 16}) == \
        HttpLimits(max_request_bytes=2**20, max_json_depth=16)
    with pytest.raises(ValueError, match=r"\[frontend\]: unknown keys \['max_body'\]"):
        HttpLimits.from_dict({"max_body": 3}, "[frontend]")
    assert HttpLimits().prompt_chars(4096) == PROMPT_CHARS_PER_TOKEN * 4096
    assert LIMITS.prompt_chars(4096) == 50


class CountingBackend(FaultyBackend):
    """Counts the characters it was asked to tokenize."""

    def __init__(self) -> None:
        self.encoded_chars = 0

    def encode(self, text: str) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode(text)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.encode("".join(content for _role, content in messages))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, CountingBackend]]:
    backend = CountingBackend()
    with ApiServer(create_app(backend, limits=LIMITS)) as api:  # type: ignore[arg-type]
        yield api.url, backend


def still_serves(url: str) -> None:
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "AB"


def test_a_declared_body_over_the_cap_is_413(served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    body = json.dumps({"prompt": [1] * 1500, "max_tokens": 2}).encode()
    assert len(body) > 2000
    reply = httpx.post(f"{url}/v1/completions", content=body,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert error["code"] == "request_too_large"
    assert error["message"] == (f"the request body ({len(body)} bytes) exceeds this server's "
                                "limit of 2000 bytes (max_request_bytes); send a shorter "
                                "request")
    still_serves(url)


def test_a_chunked_body_is_cut_off_at_the_cap(served: tuple[str, CountingBackend]) -> None:
    url, _ = served

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": ['
        for _ in range(300):
            yield b"1, 1, 1, 1,"
        yield b' 1], "max_tokens": 2}'

    reply = httpx.post(f"{url}/v1/chat/completions", content=chunks(),
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert "more than 2000 bytes" in reply.json()["error"]["message"]
    still_serves(url)


def test_json_deeper_than_the_cap_is_refused_before_parsing(
        served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    deep = '{"prompt": "hi", "logit_bias": ' + nested(8, "1") + "}"  # 9 levels with the object
    reply = httpx.post(f"{url}/v1/completions", content=deep.encode(),
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["code"], error["message"]) == (
        "json_too_deep", "the request body nests JSON arrays/objects deeper than 8 levels; "
        "flatten it")
    shallow = '{"prompt": "hi", "logit_bias": ' + nested(7, "1") + "}"  # 8 levels: parsed
    reply = httpx.post(f"{url}/v1/completions", content=shallow.encode(),
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logit_bias"
    still_serves(url)


@pytest.mark.parametrize(("route", "payload"), [
    ("completions", {"prompt": "x" * 51}),
    ("completions", {"prompt": ["x" * 51]}),
    ("chat/completions", {"messages": [{"role": "system", "content": "x" * 30},
                                       {"role": "user", "content": "y" * 21}]}),
])
def test_a_text_prompt_over_the_cap_is_never_tokenized(
        served: tuple[str, CountingBackend], route: str, payload: dict) -> None:
    url, backend = served
    before = backend.encoded_chars
    reply = httpx.post(f"{url}/v1/{route}", json={**payload, "max_tokens": 2})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("prompt_too_long", "prompt")
    assert error["message"].startswith("prompt: 51 characters, more than this server "
                                       "tokenizes (50: max_prompt_chars")
    assert backend.encoded_chars == before
    ok = httpx.post(f"{url}/v1/{route}", json={**payload, "max_tokens": 2} | (
        {"prompt": "x" * 50} if "prompt" in payload else
        {"messages": [{"role": "user", "content": "y" * 50}]}))
    assert ok.status_code == 200 and backend.encoded_chars == before + 50


def test_the_default_prompt_cap_follows_the_model_length() -> None:
    backend = CountingBackend()  # max_model_len 64
    with ApiServer(create_app(backend)) as api:  # type: ignore[arg-type]
        too_long = "x" * (PROMPT_CHARS_PER_TOKEN * 64 + 1)
        reply = httpx.post(f"{api.url}/v1/completions", json={"prompt": too_long})
        assert reply.status_code == 400
        assert f"({PROMPT_CHARS_PER_TOKEN * 64}: max_prompt_chars" in \
            reply.json()["error"]["message"]
        assert backend.encoded_chars == 0

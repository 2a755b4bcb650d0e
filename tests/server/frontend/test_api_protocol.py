"""Request validation and response bodies, without a server."""

from __future__ import annotations

import json

import pytest

from kvcake.server.frontend.backend import FinishReason
from kvcake.server.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    build_generate_request,
    parse_request,
    prompt_token_ids,
    render_chat_text,
)
from kvcake.server.frontend.responses import ResponseHead, completion_body, usage
from kvcake.types import RequestId


def parse(body: dict[str, object]) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps(body).encode())


def test_defaults_follow_openai() -> None:
    request = parse({"prompt": "x"})
    assert (request.max_tokens, request.temperature, request.top_p, request.n) == (16, 1.0, 1.0, 1)
    assert request.stream is False and request.stream_options is None


def test_int_where_float_is_expected_is_fine_but_not_the_reverse() -> None:
    assert parse({"prompt": "x", "temperature": 0}).temperature == 0.0
    with pytest.raises(InvalidRequest, match="max_tokens") as info:
        parse({"prompt": "x", "max_tokens": 2.0})
    assert info.value.param == "max_tokens"


def test_unknown_nested_field_is_named() -> None:
    with pytest.raises(InvalidRequest, match="'stream_options.bogus'"):
        parse({"prompt": "x", "stream": True, "stream_options": {"bogus": 1}})


def test_user_tag_is_accepted() -> None:
    assert parse({"prompt": "x", "user": "alice"}).user == "alice"


@pytest.mark.parametrize("off", [{"n": 1}, {"echo": False}, {"logprobs": None}, {"stop": []},
                                 {"presence_penalty": 0}, {"best_of": None}, {"logit_bias": {}}])
def test_off_values_of_unsupported_fields_pass(off: dict[str, object]) -> None:
    parse({"prompt": "x", **off})


def test_prompt_forms() -> None:
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    assert prompt_token_ids("ab", encode) == [97, 98]
    assert prompt_token_ids([5, 6], encode) == [5, 6]
    assert prompt_token_ids(["ab"], encode) == [97, 98]
    assert prompt_token_ids([[5, 6]], encode) == [5, 6]
    with pytest.raises(InvalidRequest, match="batch of 2"):
        prompt_token_ids([[1], [2]], encode)


def test_generate_request_budget() -> None:
    body = parse({"prompt": [1], "max_tokens": None, "top_k": -1, "seed": 3})
    request = build_generate_request(RequestId("r"), [1, 2, 3], body, None, 10, 8)
    assert (request.max_tokens, request.top_k, request.seed) == (5, 0, 3)  # as many as fit
    with pytest.raises(InvalidRequest, match="at most 5 tokens"):
        build_generate_request(RequestId("r"), [1, 2, 3], body, 6, 10, 8)
    with pytest.raises(InvalidRequest, match=r"outside the vocabulary \[0, 10\)"):
        build_generate_request(RequestId("r"), [1, 10], body, 2, 10, 8)


def test_chat_message_parts_and_template() -> None:
    request = parse_request(ChatCompletionRequest, json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}).encode())
    assert request.messages[0].text() == "ab"
    assert render_chat_text([("system", "s"), ("user", "u")]) == (
        "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n")
    with pytest.raises(InvalidRequest, match="messages"):
        parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": 3}]}')


def test_bodies() -> None:
    body = completion_body(ResponseHead("cmpl-1", 7, "tiny"), "hi", FinishReason.LENGTH,
                           usage(3, 2, 1), [4, 5])
    assert body["choices"] == [{"index": 0, "text": "hi", "logprobs": None,
                                "finish_reason": "length", "token_ids": [4, 5]}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}

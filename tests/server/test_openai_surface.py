"""The OpenAI surface people use, with the `openai` client against the default (disaggregated)
mode: `stop` strings (withheld, finish_reason "stop", also across stream chunks), vLLM's
sampling extras through `extra_body`, `--served-model-name`, neutral OpenAI fields,
`/tokenize`, `/detokenize` and `/version`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from kvcake import LLM, SamplingParams
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.frontend.api import ApiServer, create_app
from tests.server.test_disagg import ENGINE, cluster_config

PROMPT = "hello world"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = dataclasses.replace(cluster_config(tmp_path_factory, 1, 1),
                                 served_model_names=("alpha", "beta"))
    with Cluster(config, in_process=True) as cluster:
        assert cluster.backend is not None
        with ApiServer(create_app(cluster.backend)) as api:
            yield api.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _reference(client: openai.OpenAI) -> str:
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _a_stop_string(text: str) -> tuple[str, str]:
    """A two-character stop string from the middle of `text`, and the text before it."""
    for i in range(1, len(text) - 2):
        stop = text[i:i + 2]
        if "\ufffd" not in stop and text.find(stop) > 0:
            return stop, text[:text.find(stop)]
    pytest.skip("the reference output has no usable stop string")


def test_stop_string_is_withheld_and_ends_the_output(client: openai.OpenAI) -> None:
    stop, before = _a_stop_string(_reference(client))
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop, "never-there"], extra_body={"ignore_eos": True})
    assert out.choices[0].text == before
    assert out.choices[0].finish_reason == "stop"


def test_stop_string_across_stream_chunks(client: openai.OpenAI) -> None:
    stop, before = _a_stop_string(_reference(client))
    chunks = list(client.completions.create(model="alpha", prompt=PROMPT, max_tokens=24,
                                            temperature=0, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(stop not in c.choices[0].text for c in chunks)


def test_sampling_extras_through_extra_body_reach_the_engine(client: openai.OpenAI) -> None:
    extras = {"repetition_penalty": 1.8, "min_p": 0.05, "ignore_eos": True,
              "return_token_ids": True}
    out = client.completions.create(model="alpha", prompt=[5, 6, 7, 5, 6], max_tokens=20,
                                    temperature=0, frequency_penalty=1.5,
                                    presence_penalty=0.5, extra_body=extras)
    got = out.choices[0].token_ids  # type: ignore[attr-defined]
    llm = LLM("tiny", config=ENGINE)
    params = SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.8, min_p=0.05,
                            frequency_penalty=1.5, presence_penalty=0.5)
    [expected] = llm.generate([[5, 6, 7, 5, 6]], params)
    [plain] = llm.generate([[5, 6, 7, 5, 6]], SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == expected.token_ids
    assert got != plain.token_ids  # the penalties changed something


def test_served_model_names(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
    out = client.completions.create(model="beta", prompt="hi", max_tokens=2)
    assert out.model == "alpha"
    with pytest.raises(openai.NotFoundError, match="'alpha' or 'beta'"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_neutral_openai_fields_are_accepted_and_others_named(client: openai.OpenAI) -> None:
    out = client.completions.create(model="alpha", prompt="hi", max_tokens=2, best_of=1, n=1,
                                    echo=False, suffix=None, extra_body={"store": False})
    assert out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=2, tools=[],
        response_format={"type": "text"}, metadata={"k": "v"}, tool_choice="none")
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="alpha", prompt="hi", max_tokens=2, best_of=3)
    with pytest.raises(openai.BadRequestError, match="unknown field 'no_such_field'"):
        client.completions.create(model="alpha", prompt="hi", max_tokens=2,
                                  extra_body={"no_such_field": 1})


def test_tokenize_detokenize_version(url: str) -> None:
    tok = httpx.post(url + "/tokenize", json={"model": "alpha", "prompt": "hi"}).json()
    assert tok["tokens"] == [256, 104, 105] and tok["count"] == 3  # BOS, 'h', 'i'
    assert tok["max_model_len"] > 3
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.json()["count"] == len(chat.json()["tokens"]) > 1
    assert httpx.post(url + "/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.text
    both = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400
    assert httpx.get(url + "/version").json()["version"]


def test_n_choices_each_seeded_and_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model="alpha", prompt=[9, 8, 7, 6], max_tokens=6, temperature=1.0, seed=42,
                  n=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    out = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in out.choices] == [0, 1]
    llm = LLM("tiny", config=ENGINE)
    for choice, seed in zip(out.choices, (42, 43), strict=True):
        [ref] = llm.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=6, ignore_eos=True,
                                                            temperature=1.0, seed=seed))
        assert choice.token_ids == ref.token_ids  # type: ignore[attr-defined]
    assert out.choices[0].token_ids != out.choices[1].token_ids  # type: ignore[attr-defined]
    assert out.usage is not None and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == 4  # the prompt counted once
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in out.choices}


def test_completion_logprobs_are_the_models(client: openai.OpenAI) -> None:
    from kvcake.engine.engine import Engine

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = client.completions.create(model="alpha", prompt=prompt, max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True,
                                                            "return_token_ids": True})
    choice = out.choices[0]
    generated = choice.token_ids  # type: ignore[attr-defined]
    lp = choice.logprobs
    assert lp is not None and len(lp.token_logprobs) == len(generated) == 5
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)  # tokens may decode alike
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # the same log probabilities as a full forward pass over prompt + output
    _, logits = Engine("tiny", ENGINE).prompt_logits(prompt + generated)
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, token in enumerate(generated):
        assert lp.token_logprobs[i] == pytest.approx(
            float(expected[len(prompt) - 1 + i, token]), abs=1e-3)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i])  # greedy


def test_chat_logprobs_and_echo(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user",
                                                                     "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="alpha", prompt="hi", max_tokens=3, temperature=0, logprobs=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices[0].logprobs is not None]
    assert sum(len(lp.token_logprobs) for lp in streamed) == 3
    echoed = client.completions.create(model="alpha", prompt="hello", max_tokens=2,
                                       echo=True, temperature=0)
    assert echoed.choices[0].text.startswith("hello")

"""Completions' `echo` with `logprobs` (the prompt's log probabilities, as lm-eval's
loglikelihood tasks ask: echo=True, logprobs=N, max_tokens 0 or 1), with the `openai` client
against the default (disaggregated) mode, checked against a full forward pass; the single and
colocated modes carry them too."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import openai
import pytest
import torch

from kvcake.conductor import ConductorConfig
from kvcake.engine.engine import Engine
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig
from tests.server.test_disagg import ENGINE, WORKER, cluster_config, profile_dir

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # spans full blocks


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    config = dataclasses.replace(cluster_config(tmp_path_factory, 1, 1),
                                 served_model_names=("alpha",))
    with Cluster(config, in_process=True) as cluster:
        assert cluster.backend is not None
        with ApiServer(create_app(cluster.backend)) as api:
            yield openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0)


def _full_pass(token_ids: list[int]) -> torch.Tensor:
    _, logits = Engine("tiny", ENGINE).prompt_logits(token_ids)
    return torch.log_softmax(logits.float(), dim=-1)


def _check_prompt(lp: object, prompt: list[int], top: int) -> None:
    expected = _full_pass(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore[attr-defined]
    assert lp.text_offset[0] == 0  # type: ignore[attr-defined]
    for i in range(1, len(prompt)):
        value = lp.token_logprobs[i]  # type: ignore[attr-defined]
        assert value == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-3)
        best = lp.top_logprobs[i]  # type: ignore[attr-defined]
        assert 1 <= len(best) <= top  # tokens that decode alike keep the best
        assert max(best.values()) == pytest.approx(float(expected[i - 1].max()), abs=1e-3)


def test_echo_logprobs_cover_prompt_then_output(client: openai.OpenAI) -> None:
    # warm the prefix cache: the echo request must still score its whole prompt
    client.completions.create(model="alpha", prompt=PROMPT, max_tokens=1, temperature=0)
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=1, temperature=0,
                                    echo=True, logprobs=2, extra_body={"ignore_eos": True,
                                                                       "return_token_ids": True})
    choice = out.choices[0]
    lp = choice.logprobs
    generated = choice.token_ids  # type: ignore[attr-defined]
    assert lp is not None and len(generated) == 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        len(lp.text_offset) == len(PROMPT) + 1
    assert lp.text_offset == sorted(lp.text_offset)
    _check_prompt(lp, PROMPT, 2)
    expected = _full_pass(PROMPT)  # the last prompt position scores the generated token
    assert lp.token_logprobs[-1] == pytest.approx(float(expected[-1, generated[0]]), abs=1e-3)
    assert out.usage is not None and out.usage.completion_tokens == 1


def test_max_tokens_zero_with_echo_returns_the_scored_prompt(client: openai.OpenAI) -> None:
    prompt = PROMPT[:9]
    out = client.completions.create(model="alpha", prompt=prompt, max_tokens=0, temperature=0,
                                    echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and len(lp.token_logprobs) == len(prompt)
    _check_prompt(lp, prompt, 1)
    echoed = client.completions.create(model="alpha", prompt=prompt, max_tokens=0, echo=True)
    assert echoed.choices[0].logprobs is None and echoed.choices[0].text == choice.text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="alpha", prompt=prompt, max_tokens=0)


def test_streamed_echo_logprobs_lead_with_the_prompt(client: openai.OpenAI) -> None:
    prompt = PROMPT[:7]
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model="alpha", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=0,
        stream=True, extra_body={"ignore_eos": True}) if c.choices[0].logprobs is not None]
    assert chunks and chunks[0].token_logprobs[0] is None
    assert sum(len(lp.token_logprobs) for lp in chunks) == len(prompt) + 2
    expected = _full_pass(prompt)
    for i, value in enumerate(chunks[0].token_logprobs[1:len(prompt)], start=1):
        assert value == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-3)


def _echo_scored(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                              max_tokens=1)  # a cached prefix the echo must not reuse
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                    max_tokens=1, echo=True, logprobs=3, temperature=0)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == len(PROMPT) + 1
    _check_prompt(lp, PROMPT, 3)


def test_single_mode_echo_logprobs() -> None:
    backend = LocalBackend.from_config(LocalBackendConfig(engine=ENGINE))
    backend.start()
    try:
        with ApiServer(create_app(backend)) as api:
            _echo_scored(api.url)
    finally:
        backend.close()


def test_colocated_mode_echo_logprobs(tmp_path_factory: pytest.TempPathFactory) -> None:
    config = ClusterConfig.simple(1, 0, mode="colocated", engine=ENGINE, worker=dict(WORKER),
                                  conductor=ConductorConfig.from_dict({"admission": "none"}),
                                  profile_dir=profile_dir(tmp_path_factory))
    with Cluster(config, in_process=True) as cluster:
        assert cluster.backend is not None
        with ApiServer(create_app(cluster.backend)) as api:
            _echo_scored(api.url)


def test_streamed_max_tokens_zero_is_the_prompt_alone(client: openai.OpenAI) -> None:
    prompt = PROMPT[:6]
    whole = client.completions.create(model="alpha", prompt=prompt, max_tokens=0, echo=True)
    chunks = list(client.completions.create(model="alpha", prompt=prompt, max_tokens=0,
                                            echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    scored = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sum(len(lp.token_logprobs or ()) for lp in scored) == len(prompt)

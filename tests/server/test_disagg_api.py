"""The OpenAI API in front of the disaggregated backend: the official client (streaming and
not), curl, cached tokens through usage, 4xx for bad input, 429 from the Conductor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from kvcake import LLM, SamplingParams
from kvcake.conductor import ConductorConfig, DecodeStepPredictor, PrefillTimePredictor
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.cluster.profiler import Profile, cache_path
from kvcake.server.frontend.api import ApiServer, create_app
from tests.server.checks import check_curl_stream, check_min_tokens_masks_stop_ids
from tests.server.test_disagg import ENGINE, WORKER, cluster_config


class Serving:
    def __init__(self, cluster: Cluster) -> None:
        assert cluster.backend is not None
        self.cluster = cluster
        self.api = ApiServer(create_app(cluster.backend))
        self.api.start()
        self.url = self.api.url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    with Cluster(cluster_config(tmp_path_factory, 1, 1), in_process=True) as cluster:
        serving = Serving(cluster)
        yield serving
        serving.api.close()


@pytest.fixture(scope="module")
def client(server: Serving) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def random_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def test_openai_completion_equals_offline(client: openai.OpenAI) -> None:
    prompt = random_ids(1, 50)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    [ref] = LLM("tiny", config=ENGINE).generate(
        [prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert out.choices[0].text == ref.text


def test_openai_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=7,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7


def test_openai_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = random_ids(99, 300)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 288  # 18 full blocks of 16


@pytest.mark.parametrize(("body", "needle"), [
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    (b'{"prompt": "a", ', "not valid JSON"),
    ({"prompt": [1, 512]}, "512"),
    ({"prompt": [1] * 2000, "max_tokens": 100}, "maximum model length"),
    ({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
])
def test_bad_input_is_400_and_the_server_keeps_serving(server: Serving,
                                                       body: bytes | dict[str, object],
                                                       needle: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(server.url + "/v1/completions", content=raw,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]
    good = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert good.status_code == 200


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(server: Serving) -> None:
    check_curl_stream(server.url)
    plain = subprocess.run(["curl", "-s", server.url + "/v1/completions", "-H",
                            "Content-Type: application/json", "-d",
                            json.dumps({"prompt": "hi", "max_tokens": 2})],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(plain)["usage"]["prompt_tokens"] == 3


def fixed_profile(config: ClusterConfig, directory: Path) -> ClusterConfig:
    """`config` with a profile of fixed times (10 ms a prefill, 1 ms a decode step) in
    `directory`: the Conductor's predictions do not depend on this machine's load. (A profile
    measured under load can fit a polynomial whose value at a 5-token prompt is <= 0: the
    predicted TTFT is then 0 and meets any SLO.)"""
    # Under every torch thread count the launcher may look it up by (in-process workers set
    # the process's count before it does).
    for threads in range(1, max(os.cpu_count() or 1, torch.get_num_threads()) + 1):
        profile = Profile(config.model, config.engine.dtype, threads,
                          PrefillTimePredictor(1, 1.0, [0.01, 0.0, 0.0]),
                          DecodeStepPredictor([0.001, 0.0, 0.0]))
        cache_path(directory, config.model, config.engine.dtype, threads,
                   config.engine.max_num_batched_tokens).write_text(profile.to_json())
    return replace(config, profile_dir=str(directory))


def test_conductor_rejection_is_429_with_retry_after(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    config = fixed_profile(cluster_config(tmp_path_factory, 1, 1, admission="slo",
                                          ttft_slo_s=1e-3), tmp_path)
    with Cluster(config, in_process=True) as cluster:
        assert cluster.backend is not None
        api = ApiServer(create_app(cluster.backend))
        api.start()
        try:
            reply = httpx.post(api.url + "/v1/completions",
                               json={"prompt": "hello", "max_tokens": 3})
        finally:
            api.close()
        assert reply.status_code == 429
        assert int(reply.headers["Retry-After"]) >= 1
        assert "ttft_slo" in reply.json()["error"]["message"]
        assert cluster.backend.totals.num_prefills == 0


def test_prediction_based_early_rejection_is_429_when_decode_kv_would_not_fit(
        tmp_path: Path) -> None:
    # Decode workers of 8 blocks x 16 tokens: the Conductor forecasts against that pool (from the
    # worker's hello) and refuses, at arrival, a request that would reserve more. (Its own
    # profile: an 8-block engine cannot measure the profiler's 384-token prompts, so the
    # session's measured one made this test pass only after another had cached it.)
    config = fixed_profile(ClusterConfig.simple(
        1, 1, engine=replace(ENGINE, num_blocks=8), worker=dict(WORKER),
        conductor=ConductorConfig.from_dict({"admission": "early"})), tmp_path)
    with Cluster(config, in_process=True) as cluster:
        assert cluster.backend is not None
        api = ApiServer(create_app(cluster.backend))
        api.start()
        try:
            reply = httpx.post(api.url + "/v1/completions",
                               json={"prompt": [1, 2, 3], "max_tokens": 200})
            small = httpx.post(api.url + "/v1/completions",
                               json={"prompt": [1, 2, 3], "max_tokens": 4})
        finally:
            api.close()
        assert reply.status_code == 429, reply.text
        assert int(reply.headers["Retry-After"]) >= 1
        assert "tbt_slo" in reply.json()["error"]["message"]
        assert small.status_code == 200, small.text
        assert cluster.backend.totals.num_prefills == 1


def test_min_tokens_masks_stop_ids_until_reached(server) -> None:  # type: ignore[no-untyped-def]
    check_min_tokens_masks_stop_ids(server.url)

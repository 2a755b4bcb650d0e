"""Replays a Mooncake trace against an OpenAI-compatible server and records what came back.

Each trace record becomes one streaming `/v1/completions` request with a token-id prompt (see
`prompts.py`), sent at the record's `timestamp` divided by `speed`, with `max_tokens` = the
scaled output length and `ignore_eos` + `min_tokens` set so that the output length is exact on
servers that honour them (ours, vLLM). Every SSE chunk that carries a choice counts as one token
arrival; the output length is taken from the final usage chunk when the server sends one.

A 429 is recorded as `REJECTED` (not retried: a rejected request is a miss of the SLO by
definition); any other HTTP error, a broken stream or a timeout is an `ERROR`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvcake.bench.prompts import PromptBuilder
from kvcake.bench.stats import Outcome, RequestResult
from kvcake.clock import Clock, SystemClock
from kvcake.sim.trace import TraceRequest


@dataclass(frozen=True)
class ReplayConfig:
    url: str
    model: str | None = None
    speed: float = 1.0
    request_timeout_s: float = 600.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"--speed must be > 0, got {self.speed}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")


@dataclass(frozen=True)
class PlannedRequest:
    send_at_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int


def plan(records: Sequence[TraceRequest], builder: PromptBuilder,
         speed: float) -> list[PlannedRequest]:
    """Prompts and send times of `records`, the first one at offset 0."""
    if not records:
        return []
    start_ms = min(r.timestamp_ms for r in records)
    return [
        PlannedRequest(
            send_at_s=(r.timestamp_ms - start_ms) / 1000.0 / speed,
            prompt_token_ids=builder.build(r.hash_ids, r.input_len, r.index),
            max_tokens=builder.scaled_len(r.output_len),
        )
        for r in records
    ]


async def fetch_model_info(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The first entry of the server's /v1/models (vLLM and we report `max_model_len`)."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
            response = await client.get("/v1/models")
            response.raise_for_status()
            models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"--url: cannot read {url}/v1/models ({type(exc).__name__}: {exc}); "
                         "is the server up?") from None
    if not models:
        raise ValueError(f"{url}/v1/models lists no model; pass --model and --vocab-size")
    return dict(models[0])


async def replay(planned: Sequence[PlannedRequest], config: ReplayConfig,
                 clock: Clock | None = None,
                 on_done: Callable[[RequestResult], None] | None = None,
                 ) -> tuple[list[RequestResult], float]:
    """Send every planned request on time; returns the results (in plan order) and duration."""
    clock = clock or SystemClock()
    limits = httpx.Limits(max_connections=config.max_connections,
                          max_keepalive_connections=config.max_connections)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=config.url, limits=limits, timeout=timeout) as client:
        start_s = clock.now_s()

        async def send_when_due(p: PlannedRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start_s + p.send_at_s - clock.now_s()))
            result = await send_one(client, p, config.model, clock)
            if on_done is not None:
                on_done(result)
            return result

        results = await asyncio.gather(*(send_when_due(p) for p in planned))
        return list(results), max(clock.now_s() - start_s, 1e-9)


async def send_one(client: httpx.AsyncClient, planned: PlannedRequest, model: str | None,
                   clock: Clock) -> RequestResult:
    body: dict[str, Any] = {
        "prompt": planned.prompt_token_ids, "max_tokens": planned.max_tokens,
        "min_tokens": planned.max_tokens, "ignore_eos": True, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    prompt_len = len(planned.prompt_token_ids)
    sent_s = clock.now_s()
    arrivals: list[float] = []
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")[:300]
                outcome = Outcome.REJECTED if response.status_code == 429 else Outcome.ERROR
                return RequestResult(outcome, prompt_len, error=f"HTTP {response.status_code}: "
                                     f"{text}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"error event: {chunk['error']}")
                if chunk.get("choices"):
                    arrivals.append(clock.now_s() - sent_s)
                if chunk.get("usage"):
                    usage_tokens = int(chunk["usage"]["completion_tokens"])
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
        return RequestResult(Outcome.ERROR, prompt_len, error=f"{type(exc).__name__}: {exc}")
    if not arrivals:
        return RequestResult(Outcome.ERROR, prompt_len, error="the stream carried no tokens")
    gaps = tuple(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    return RequestResult(
        Outcome.OK, prompt_len, output_len=usage_tokens if usage_tokens is not None
        else len(arrivals), ttft_s=arrivals[0], gaps_s=gaps, latency_s=clock.now_s() - sent_s,
    )

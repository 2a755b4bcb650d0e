"""`--engine-process`: the single-mode engine in a child process (`ProcessBackend`) answers as
the in-process `LocalBackend` does: the same greedy tokens, a bad request refused with
ValueError (400), an early close aborts, and a dead engine process fails new requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvcake.engine.config import EngineConfig
from kvcake.server.frontend.backend import GenerateRequest, TokenEvent
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig
from kvcake.server.frontend.process_backend import ProcessBackend
from kvcake.types import RequestId

CONFIG = LocalBackendConfig(engine=EngineConfig(max_model_len=64), num_threads=1)
PROMPT = (5, 6, 7, 8, 9)


async def _events(backend: LocalBackend | ProcessBackend, rid: str, prompt: tuple[int, ...],
                  max_tokens: int) -> list[TokenEvent]:
    stream = await backend.generate(GenerateRequest(RequestId(rid), prompt, max_tokens,
                                                    temperature=0.0, ignore_eos=True))
    return [event async for event in stream]


@pytest.fixture(scope="module")
def child() -> Iterator[ProcessBackend]:
    with ProcessBackend(CONFIG) as backend:
        yield backend


def test_the_same_greedy_tokens_as_the_in_process_engine(child: ProcessBackend) -> None:
    with LocalBackend.from_config(CONFIG) as local:
        expected = asyncio.run(_events(local, "a", PROMPT, 6))
    got = asyncio.run(_events(child, "a", PROMPT, 6))
    assert [e.token_ids for e in got] == [e.token_ids for e in expected]
    assert [e.finish_reason for e in got] == [e.finish_reason for e in expected]
    assert got[0].queue_s is not None and got[0].prefill_s is not None
    assert child.num_live_requests == 0 and child.max_model_len == 64


def test_a_request_the_engine_refuses_is_a_value_error(child: ProcessBackend) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(_events(child, "long", PROMPT, 100))
    assert child.num_live_requests == 0
    assert len(asyncio.run(_events(child, "after", PROMPT, 2))) >= 1  # still serving


def test_closing_a_stream_early_aborts_it(child: ProcessBackend) -> None:
    async def first_then_close() -> TokenEvent:
        stream = await child.generate(GenerateRequest(RequestId("x"), PROMPT, 20,
                                                      temperature=0.0))
        event = await stream.__anext__()
        await stream.aclose()
        return event

    assert asyncio.run(first_then_close()).finish_reason is None
    assert child.num_live_requests == 0
    events = asyncio.run(_events(child, "next", PROMPT, 3))
    assert sum(len(e.token_ids) for e in events) == 3


def test_a_dead_engine_process_fails_new_requests() -> None:
    backend = ProcessBackend(CONFIG)
    backend.start()
    try:
        backend._process.kill()
        assert backend._reader is not None
        backend._reader.join(timeout=30)  # it reads EOF and marks the backend dead
        with pytest.raises(RuntimeError, match="engine process exited"):
            asyncio.run(_events(backend, "late", PROMPT, 2))
    finally:
        backend.close()

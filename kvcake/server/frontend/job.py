"""One admitted request as the HTTP API sees it (`Job`), and how the events of a request's
choices (n > 1) are merged into one stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvcake.server.frontend.backend import FinishReason, TokenEvent, TokenStream
from kvcake.server.frontend.detokenizer import TextStream
from kvcake.server.frontend.metrics import RequestTimer


@dataclass
class Job:
    """One admitted request as the API sees it."""

    request_id: str
    kind: str  # "completion" | "chat"
    num_prompt_tokens: int
    stream: TokenStream
    timer: RequestTimer
    include_usage: bool
    return_token_ids: bool
    created: int
    text: TextStream
    num_cached_tokens: int = 0
    index: int = 0  # the choice's index (n > 1)
    wants_logprobs: bool = False
    echo: str = ""  # completions' echo: the prompt's text, before the output
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprob of every token so far
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: list[Any] = field(default_factory=list)  # echo + logprobs: the prompt's
    drop_output: bool = False  # max_tokens 0 (echo): the one token the engine samples is dropped
    text_len: int = 0  # characters sent so far (completions' text_offset)
    finish_reason: FinishReason = FinishReason.ABORT


async def close_all(jobs: list[Job]) -> None:
    for job in jobs:
        await job.stream.aclose()


async def merged(events: Callable[[Job], AsyncIterator[tuple[TokenEvent, str]]],
                  jobs: list[Job]) -> AsyncIterator[tuple[Job, TokenEvent, str]]:
    """The events of every job as they come (one job: its own order, no extra task)."""
    if len(jobs) == 1:
        async for event, text in events(jobs[0]):
            yield jobs[0], event, text
        return
    queue: asyncio.Queue[tuple[Job, TokenEvent, str] | BaseException | None] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for event, text in events(job):
                await queue.put((job, event, text))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        done = 0
        while done < len(jobs):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await close_all(jobs)

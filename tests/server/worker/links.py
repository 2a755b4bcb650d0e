"""Reading a real worker's control link in tests."""

from __future__ import annotations

from typing import Any, TypeVar, overload

from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import Message

M = TypeVar("M")


@overload
def next_of(link: MessageLink, kind: type[M], /) -> M: ...


@overload
def next_of(link: MessageLink, *kinds: type) -> Message: ...


def next_of(link: MessageLink, *kinds: type) -> Any:
    """The next message of one of `kinds` (load and KV reports in between are skipped)."""
    while True:
        message = link.recv()
        assert message is not None, "the worker closed the link"
        if isinstance(message, kinds):
            return message

"""Reading a real worker's control link in tests."""

from __future__ import annotations

from kvcake.server.worker.messages import Message, MessageLink


def next_of(link: MessageLink, *kinds: type) -> Message:
    """The next message of one of `kinds` (load and KV reports in between are skipped)."""
    while True:
        message = link.recv()
        assert message is not None, "the worker closed the link"
        if isinstance(message, kinds):
            return message

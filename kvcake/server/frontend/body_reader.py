"""Reading a client's request within the caps of `HttpLimits` (limits.py), before the work each
cap protects: the body's bytes before they are all read (413), its JSON nesting before it is
parsed (400), and a text prompt's characters before it is tokenized (400).
"""

from __future__ import annotations

from fastapi import Request

from kvcake.server.frontend.limits import PROMPT_CHARS_PER_TOKEN, HttpLimits, json_depth_exceeds
from kvcake.server.frontend.protocol import InvalidRequest


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request body, refused (413) past `max_request_bytes` before it is all read, and
    (400) when its JSON nests deeper than `max_json_depth`, before it is parsed."""
    cap = limits.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise _too_large(f"{int(declared)} bytes", cap)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _too_large(f"more than {cap} bytes", cap)
        chunks.append(chunk)
    body = b"".join(chunks)
    if json_depth_exceeds(body, limits.max_json_depth):
        raise InvalidRequest(f"the request body nests JSON arrays/objects deeper than "
                             f"{limits.max_json_depth} levels; flatten it",
                             code="json_too_deep")
    return body


def check_prompt_chars(limits: HttpLimits, max_model_len: int, texts: list[str]) -> None:
    """A text prompt too long to fit is refused before the tokenizer spends time on it."""
    cap = limits.prompt_chars(max_model_len)
    chars = sum(len(text) for text in texts)
    if chars > cap:
        raise InvalidRequest(
            f"prompt: {chars} characters, more than this server tokenizes ({cap}: "
            f"max_prompt_chars, by default {PROMPT_CHARS_PER_TOKEN} per token of the "
            f"maximum model length {max_model_len}); shorten the prompt",
            "prompt", code="prompt_too_long")


def _too_large(size: str, cap: int) -> InvalidRequest:
    return InvalidRequest(f"the request body ({size}) exceeds this server's limit of {cap} "
                          f"bytes (max_request_bytes); send a shorter request", status=413,
                          code="request_too_large")

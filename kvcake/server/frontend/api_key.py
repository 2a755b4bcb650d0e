"""`--api-key`: the HTTP API asks for `Authorization: Bearer <key>`, as `vllm serve --api-key`.

Every path under `/v1` needs the key; `/health` and `/metrics` (probes, Prometheus) and the rest
stay open. A request without the right key gets 401 with OpenAI's error body (type
`invalid_request_error`, code `invalid_api_key`) and `WWW-Authenticate: Bearer`, before its body
is read. Keys are compared in constant time (`hmac.compare_digest`).

A pure ASGI middleware (not Starlette's `BaseHTTPMiddleware`): the app's streaming responses and
its client-disconnect watch see the connection's own `receive`, unchanged.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvcake.server.frontend.responses import error_body

ENV_VAR = "KVCAKE_API_KEY"
PROTECTED_PREFIX = "/v1"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def resolve_api_key(flag: str | None) -> str | None:
    """The key from `--api-key`, else from `$KVCAKE_API_KEY`, else None (no key asked)."""
    key = flag if flag is not None else os.environ.get(ENV_VAR)
    if key is None or key == "":
        return None
    if key != key.strip() or any(ord(c) < 0x21 or ord(c) > 0x7e for c in key):
        raise ValueError("--api-key / KVCAKE_API_KEY: use printable ASCII without spaces (it "
                         "travels in an HTTP header)")
    return key


class ApiKeyGuard:
    """ASGI middleware: 401 for a `/v1` request whose bearer token is not one of `keys`."""

    def __init__(self, app: App, keys: tuple[str, ...]) -> None:
        if not keys or any(not k for k in keys):
            raise ValueError("ApiKeyGuard: give at least one non-empty key")
        self.app = app
        self._expected = tuple(f"Bearer {k}".encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _protected(scope.get("path", "")) \
                or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(
            "Incorrect or missing API key: send the server's --api-key as "
            "'Authorization: Bearer <key>'", 401, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = bytes(value)
                break
        ok = False
        for expected in self._expected:  # every key compared: no early exit on a match
            ok |= hmac.compare_digest(given, expected)
        return ok


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")

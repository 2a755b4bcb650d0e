"""The request bodies in the app's OpenAPI schema (`/openapi.json`).

The POST routes read their body themselves (size and depth caps before parsing: limits.py), so
FastAPI does not see a body model; `request_body(Model)` gives the route's `openapi_extra` with
the pydantic model's JSON schema, its `$defs` inlined, so that the document describes what the
server accepts (clients, API fuzzers: tests/server/frontend/test_api_fuzz.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": _inline(schema, defs, ())}}}}


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.rsplit("/", 1)[1]
            if name in seen:
                raise ValueError(f"request_body: recursive model {name!r} cannot be inlined")
            return _inline(defs[name], defs, (*seen, name))
        return {k: _inline(v, defs, seen) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs, seen) for v in node]
    return node

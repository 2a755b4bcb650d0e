"""The store master's wire arguments that are lists (batch items, slot commits, a reserve
request), checked into typed tuples, and `batch_entry`, one batch item's answer. A malformed one
is an `InvalidRequest` that says the expected shape. Pure.
"""

from __future__ import annotations

from typing import Any

from kvcake.store.errors import InvalidRequest, ObjectNotFound, StoreError


def key_arg(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"key: must be a string, got {type(value).__name__}")
    return value


def key_size_checksum(item: Any) -> tuple[str, int, int | None]:
    if not (isinstance(item, list | tuple) and len(item) in (2, 3) and isinstance(item[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in item[1:])):
        raise InvalidRequest("items: each must be [key, size_bytes] or [key, size_bytes, checksum]")
    return item[0], item[1], item[2] if len(item) == 3 else None


def key_checksum(item: Any) -> tuple[str, int | None]:
    if isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[1], int) \
            and not isinstance(item[1], bool):
        return key_arg(item[0]), item[1]
    return key_arg(item), None


def _is_int(value: Any) -> bool:
    """An integer and not a bool (on every commit: spelled out, no generator)."""
    return isinstance(value, int) and not isinstance(value, bool)


def commit_item(item: Any) -> tuple[str, int, int, int]:
    if not (isinstance(item, list | tuple) and len(item) == 4 and isinstance(item[0], str)
            and _is_int(item[1]) and _is_int(item[2]) and _is_int(item[3])):
        raise InvalidRequest("commits: each must be [key, slot, size_bytes, checksum]")
    return item[0], item[1], item[2], item[3]


def reserve_spec(spec: Any) -> tuple[int, int, int | None, str | None]:
    ok = isinstance(spec, list | tuple) and len(spec) == 4 \
        and _is_int(spec[0]) and _is_int(spec[1]) \
        and (spec[2] is None or _is_int(spec[2])) \
        and (spec[3] is None or isinstance(spec[3], str))
    if not ok:
        raise InvalidRequest("reserve: must be [size_bytes, count, num_replicas or null, "
                             "local_node or null]")
    return spec[0], spec[1], spec[2], spec[3]


def batch_entry(call: Any) -> dict[str, Any]:
    """One batch entry: {"ok": True, "result": ...} or {"ok": False, "error": {...}}."""
    try:
        return {"ok": True, "result": call()}
    except (StoreError, KeyError, ValueError) as exc:
        name = type(exc).__name__ if isinstance(exc, StoreError) else "StoreError"
        if isinstance(exc, KeyError) and not isinstance(exc, StoreError):
            name, exc = "ObjectNotFound", ObjectNotFound(str(exc))
        return {"ok": False, "error": {"type": name, "message": str(exc)}}

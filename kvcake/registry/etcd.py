"""`Etcd`: the etcd operations kvcake needs (leases, put/get/delete, a create-if-absent
transaction, prefix listing with its revision, waiting for a change under a prefix), over etcd's v3 JSON gateway.

Why etcd3gw: it is maintained (OpenStack, releases in 2026), pure Python over `requests`, and
speaks the JSON gateway every etcd >= 3.3 serves on its client port. The gRPC client `etcd3`
(python-etcd3) has had no release since 2020 and pins an old protobuf that conflicts with current
packages; `aetcd` is asyncio-only (our callers are threads); v2-API clients (`python-etcd`) do
not reach the v3 keyspace. Membership traffic is a few requests per second, so the gateway's
HTTP+JSON cost does not matter.

Endpoints are "HOST:PORT[,HOST:PORT...]"; an operation that cannot reach one endpoint moves to
the next, and raises `EtcdUnavailable` naming all of them when none answers.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable
from typing import Any

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors

# What the gateway raises when an endpoint is down or slow.
_UNREACHABLE = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
                etcd_errors.InternalServerError, etcd_errors.ApiVersionDiscoveryFailedError,
                OSError)


class EtcdUnavailable(ConnectionError):
    """No etcd endpoint answered."""


def parse_endpoints(text: str | list[str] | tuple[str, ...], field: str = "--etcd"
                    ) -> tuple[tuple[str, int], ...]:
    """"HOST:PORT[,HOST:PORT]" (or a list of them) -> ((host, port), ...); ValueError naming
    `field` otherwise."""
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text)]
    out = []
    for item in items:
        item = item.removeprefix("http://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{field}: expected HOST:PORT[,HOST:PORT...], got {text!r}")
        out.append((host, int(port)))
    if not out:
        raise ValueError(f"{field}: no endpoint given")
    return tuple(out)


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix`."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


class Etcd:
    """Thread-safe (each call is one HTTP request on its own `requests` session)."""

    def __init__(self, endpoints: str | list[str] | tuple[str, ...],
                 timeout_s: float = 5.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self._timeout_s = timeout_s
        self._clients = [etcd3gw.client(host=h, port=p, timeout=timeout_s, api_path="/v3/")
                         for h, p in self.endpoints]
        self._current = 0
        self._lock = threading.Lock()

    @property
    def text(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _call(self, op: Callable[[Any], Any]) -> Any:
        with self._lock:
            start = self._current
        errors = []
        for i in range(len(self._clients)):
            index = (start + i) % len(self._clients)
            try:
                result = op(self._clients[index])
            except _UNREACHABLE as exc:
                errors.append(f"{self.endpoints[index][0]}:{self.endpoints[index][1]}: "
                              f"{type(exc).__name__}")
                continue
            with self._lock:
                self._current = index
            return result
        raise EtcdUnavailable(f"etcd unreachable at {self.text} ({'; '.join(errors)}): is "
                              "`etcd` running there?")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call(lambda c: c.post(c.get_url(path), json=body)))

    # ---- leases --------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        """A new lease id; etcd rounds a TTL below its minimum (about 2 s) up."""
        return int(self._post("/lease/grant", {"TTL": int(ttl_s), "ID": 0})["ID"])

    def keepalive(self, lease_id: int) -> int:
        """The lease's renewed TTL, or -1 if it had already expired."""
        result = self._post("/lease/keepalive", {"ID": lease_id}).get("result", {})
        return int(result.get("TTL", -1))

    def revoke(self, lease_id: int) -> None:
        """End the lease and delete its keys (a lease already gone is not an error)."""
        try:
            self._post("/kv/lease/revoke", {"ID": lease_id})
        except etcd_errors.Etcd3Exception as exc:
            if "not found" not in str(exc).lower():
                raise

    # ---- keys ----------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id is not None:
            body["lease"] = lease_id
        self._post("/kv/put", body)

    def get(self, key: str) -> bytes | None:
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def delete(self, key: str) -> None:
        self._post("/kv/deleterange", {"key": _b64(key)})

    def list_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """({key: value} under `prefix`, the store's revision of that answer)."""
        result = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        items = {_unb64(kv["key"]).decode(): _unb64(kv.get("value", ""))
                 for kv in result.get("kvs", [])}
        return items, int(result["header"]["revision"])

    def create(self, key: str, value: bytes, lease_id: int) -> tuple[bool, bytes | None]:
        """Put `key` under the lease only if it does not exist, in one transaction: (created,
        the value that holds the key otherwise)."""
        txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                            "create_revision": 0}],
               "success": [{"request_put": {"key": _b64(key), "value": _b64(value),
                                            "lease": lease_id}}],
               "failure": [{"request_range": {"key": _b64(key)}}]}
        result = self._post("/kv/txn", txn)
        if result.get("succeeded"):
            return True, None
        for response in result.get("responses", []):
            kvs = response.get("response_range", {}).get("kvs", [])
            if kvs:
                return False, _unb64(kvs[0].get("value", ""))
        return False, None

    def delete_if_value(self, key: str, value: bytes) -> bool:
        """Delete `key` only if it still holds `value` (a leader resigning its own key)."""
        txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "VALUE",
                            "value": _b64(value)}],
               "success": [{"request_delete_range": {"key": _b64(key)}}]}
        return bool(self._post("/kv/txn", txn).get("succeeded"))

    def wait_change(self, prefix: str, start_revision: int, wait_s: float) -> bool:
        """Block until a key under `prefix` changes at or after `start_revision` (True) or
        `wait_s` passes without a change (False). One watch stream per call, closed on return:
        callers list, then wait from the next revision, so no change between the two is missed."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": start_revision}}

        def watch(client: Any) -> bool:
            try:
                response = client.session.post(client.get_url("/watch"), json=body, stream=True,
                                               timeout=(self._timeout_s, wait_s))
            except requests.exceptions.ReadTimeout:
                return False
            except requests.exceptions.RequestException as exc:
                raise etcd_errors.ConnectionFailedError(str(exc)) from None
            try:
                for line in response.iter_lines():
                    if line.strip() and json.loads(line).get("result", {}).get("events"):
                        return True
                return False
            except (requests.exceptions.RequestException, ValueError):
                return False  # read timeout (no change) or the stream ended: list again
            finally:
                response.close()

        return bool(self._call(watch))

    def status(self) -> dict[str, Any]:
        """The answering member's status (raises EtcdUnavailable when none answers)."""
        return self._post("/maintenance/status", {})

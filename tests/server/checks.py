"""Checks over HTTP that every serving mode must pass; each test module calls them on its own
server."""

from __future__ import annotations

import json
import subprocess

import httpx


def check_min_tokens_masks_stop_ids(url: str) -> None:
    """The greedy first token made a stop id: without min_tokens the request stops at once;
    with min_tokens=3 that token is masked until three tokens exist."""
    body = {"prompt": "The cat", "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    stop_id = first["choices"][0]["token_ids"][0]
    stopped = httpx.post(url + "/v1/completions", timeout=60,
                         json={**body, "stop_token_ids": [stop_id]}).json()
    assert stopped["usage"]["completion_tokens"] == 1
    assert stopped["choices"][0]["finish_reason"] == "stop"
    held = httpx.post(url + "/v1/completions", timeout=60,
                      json={**body, "stop_token_ids": [stop_id], "min_tokens": 3}).json()
    ids = held["choices"][0]["token_ids"]
    assert len(ids) >= 3 and stop_id not in ids[:3]


def check_curl_stream(url: str) -> list[dict[str, object]]:
    """A streamed completion through `curl -sN`: SSE events ending in [DONE], the last chunk
    finished by length. Returns the chunks."""
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "stream": True, "ignore_eos": True})
    out = subprocess.run(["curl", "-sN", url + "/v1/completions", "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return chunks

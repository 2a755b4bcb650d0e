"""`--api-key`: the official `openai` client is refused (401, OpenAI's error body) without the
key or with a wrong one and served with it; `/health` and `/metrics` stay open; the backend
never sees a refused request."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.api_key import ENV_VAR, resolve_api_key
from kvcake.server.frontend.backend import GenerateRequest
from tests.server.frontend.test_api_errors import FaultyBackend

KEY = "sk-kvcake-test-0123"


class SeenBackend(FaultyBackend):
    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []

    async def generate(self, request: GenerateRequest):  # type: ignore[no-untyped-def]
        self.seen.append(tuple(request.prompt_token_ids))
        return await super().generate(request)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, SeenBackend]]:
    backend = SeenBackend()
    with ApiServer(create_app(backend, api_key=KEY)) as api:
        yield api.url, backend


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_the_right_key_is_served(served: tuple[str, SeenBackend]) -> None:
    url, backend = served
    client = _client(url, KEY)
    assert [m.id for m in client.models.list().data] == ["faulty"]
    out = client.completions.create(model="faulty", prompt=[1, 2], max_tokens=2)
    assert out.choices[0].text == "AB"
    stream = client.completions.create(model="faulty", prompt=[3], max_tokens=2, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "AB"
    assert backend.seen[-2:] == [(1, 2), (3,)]


@pytest.mark.parametrize("key", ["sk-wrong", KEY + "x", KEY[:-1]])
def test_a_wrong_key_is_401_and_never_reaches_the_backend(served: tuple[str, SeenBackend],
                                                          key: str) -> None:
    url, backend = served
    before = len(backend.seen)
    with pytest.raises(openai.AuthenticationError) as caught:
        _client(url, key).completions.create(model="faulty", prompt=[7], max_tokens=2)
    assert caught.value.status_code == 401
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        _client(url, key).chat.completions.create(
            model="faulty", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        _client(url, key).models.list()
    assert len(backend.seen) == before


def test_no_key_or_another_scheme_is_401(served: tuple[str, SeenBackend]) -> None:
    url, _backend = served
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"bearer {KEY}"}, {"Authorization": f"Bearer {KEY}0"}):
        reply = httpx.post(url + "/v1/completions", json={"prompt": [1]}, headers=headers)
        assert reply.status_code == 401
        assert reply.headers["www-authenticate"] == "Bearer"
        assert reply.json()["error"]["code"] == "invalid_api_key"
    # A huge unauthenticated body is refused before it is read (no 413 / 400 from parsing).
    assert httpx.post(url + "/v1/completions", content=b"{" * 100_000).status_code == 401


def test_health_and_metrics_stay_open(served: tuple[str, SeenBackend]) -> None:
    url, _backend = served
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/metrics").status_code == 200


def test_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv(ENV_VAR, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-flag") == "from-flag"
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        resolve_api_key("two words")

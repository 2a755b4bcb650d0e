"""Serving a Hugging Face model directory: its tokenizer and its chat template are used."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from tokenizers import Tokenizer, models, pre_tokenizers

from kvcake.engine.config import PRESETS, EngineConfig
from kvcake.engine.loader import dummy_weights, save_hf_dir
from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")


def make_model_dir(path: Path, with_template: bool) -> Path:
    config = PRESETS["tiny"]
    save_hf_dir(config, dummy_weights(config, 3), path)
    words = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    if with_template:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


def test_chat_uses_the_directory_template(tmp_path: Path) -> None:
    model = str(make_model_dir(tmp_path / "m", with_template=True))
    config = LocalBackendConfig(model=model, engine=EngineConfig(kv_cache_bytes=8 * 2**20))
    with LocalBackend.from_config(config) as backend, ApiServer(create_app(backend)) as api:
        # "user" and "assistant" are not words of this vocabulary: both map to w0 (unknown).
        assert backend.chat_prompt([("user", "w5 w6")]) == [0, 5, 6, 0]
        reply = httpx.post(api.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3,
            "ignore_eos": True, "return_token_ids": True}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == 4
        ids = reply.json()["choices"][0]["token_ids"]
        assert reply.json()["choices"][0]["message"]["content"] == " ".join(
            f"w{i}" for i in ids)
        text = httpx.post(api.url + "/v1/completions", json={"prompt": "w1 w2 w3",
                                                             "max_tokens": 2}, timeout=60)
        assert text.json()["usage"]["prompt_tokens"] == 3


def test_without_template_the_builtin_one_is_used(tmp_path: Path) -> None:
    model = str(make_model_dir(tmp_path / "m", with_template=False))
    config = LocalBackendConfig(model=model, engine=EngineConfig(kv_cache_bytes=8 * 2**20))
    backend = LocalBackend.from_config(config)
    # "<|user|>\nw5\n<|assistant|>\n" splits on whitespace into 3 words: unknown, w5, unknown
    assert backend.chat_prompt([("user", "w5")]) == [0, 5, 0]

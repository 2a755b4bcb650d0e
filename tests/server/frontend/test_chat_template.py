"""A Hugging Face directory's own chat template, in every mode: the prompt's token ids equal
transformers' `apply_chat_template` for the same messages, for each of the three forms a
template takes (tokenizer_config.json string, a list of named templates, chat_template.jinja).

`ModelFront` renders chats for the disaggregated and colocated modes (the frontend tokenizes
before the Conductor places anything); `LocalBackend` for `--mode single`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcake.engine.config import PRESETS, EngineConfig
from kvcake.engine.loader import dummy_weights, save_hf_dir
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig
from kvcake.server.frontend.model_front import ModelFront

transformers = pytest.importorskip("transformers")

SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]"]
# Mistral-like: BOS written by the template, EOS after each reply, whitespace control.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}\n"
            "  {% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
            "{% elif m['role'] == 'system' %}{{ m['content'] }} "
            "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}\n"
            "{% endfor %}{% if add_generation_prompt %} w7{% endif %}")
MESSAGES = [("system", "w1 w2"), ("user", " w3  w4 "), ("assistant", "w5"), ("user", "w6")]


def _model_dir(path: Path, form: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    config = PRESETS["tiny"]
    save_hf_dir(config, dummy_weights(config, 3), path)
    words = {f"w{i}": i for i in range(500)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)  # ids 500..503
    # Like Llama's: encoding text adds BOS, so a template's own BOS must not be doubled.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 500)])
    tok.save(str(path / "tokenizer.json"))
    tok_config: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>",
                                                                "special": True},
                                  "tokenizer_class": "PreTrainedTokenizerFast"}
    if form == "string":
        tok_config["chat_template"] = TEMPLATE
    elif form == "named":
        tok_config["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('x') }}"},
                                       {"name": "default", "template": TEMPLATE}]
    else:
        (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def _transformers_ids(path: Path) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    out = tok.apply_chat_template([{"role": r, "content": c} for r, c in MESSAGES],
                                  add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


@pytest.mark.parametrize("form", ["string", "named", "jinja_file"])
def test_the_prompt_equals_transformers_apply_chat_template(tmp_path: Path, form: str) -> None:
    path = _model_dir(tmp_path / form, form)
    expected = _transformers_ids(path)
    assert expected[0] == 500 and expected.count(500) == 1  # one BOS: not added twice
    assert 501 in expected  # the template's EOS after the assistant's reply
    assert ModelFront(str(path)).chat_prompt(MESSAGES) == expected  # disaggregated, colocated
    config = LocalBackendConfig(model=str(path), engine=EngineConfig(kv_cache_bytes=2**21,
                                                                     linear_backend="aten"))
    assert LocalBackend.from_config(config).chat_prompt(MESSAGES) == expected  # single


def test_a_template_that_refuses_the_messages_is_a_clear_error(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "m", "string")
    raw = json.loads((path / "tokenizer_config.json").read_text())
    raw["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (path / "tokenizer_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="chat template refused them: roles must alternate"):
        ModelFront(str(path)).chat_prompt(MESSAGES)


def test_a_template_that_does_not_compile_names_its_file(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "m", "jinja_file")
    (path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="chat_template.jinja does not compile"):
        ModelFront(str(path))

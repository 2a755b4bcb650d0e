"""A Hugging Face model's own chat template, rendered as transformers' `apply_chat_template`.

`ChatTemplate.load(directory)` finds the template in any of its three forms (`chat_template.jinja`;
`tokenizer_config.json`'s `chat_template` as a string, or as a list of named templates, of which
"default" is taken) and compiles it once. `render(messages)` gives the text (the special tokens
spelled out, as the template writes them), to be tokenized *without* adding special tokens again
(`encode_chat`), which is what transformers does, so the prompt's token ids are the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 origin: str = "chat template") -> None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"messages: the model's chat template refused them: {message}")

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)  # compiled once
        except jinja2.TemplateError as exc:
            raise ValueError(f"model: {origin} does not compile ({exc})") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def load(cls, directory: Path | str) -> ChatTemplate | None:
        """The directory's template, or None when it has none."""
        path = Path(directory)
        config: dict[str, Any] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"model: {config_path} is not valid JSON ({exc})") from None
        special = {name: _token_text(config.get(name)) for name in _SPECIAL
                   if _token_text(config.get(name)) is not None}
        jinja_path = path / "chat_template.jinja"
        if jinja_path.is_file():
            return cls(jinja_path.read_text(), special, str(jinja_path))  # type: ignore[arg-type]
        raw = config.get("chat_template")
        if isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            raw = named.get("default", next(iter(named.values()), None))
        if raw is None:
            return None
        if not isinstance(raw, str):
            raise ValueError(f"model: {config_path}: chat_template must be a string or a list "
                             f"of {{name, template}} objects")
        return cls(raw, special, str(config_path))  # type: ignore[arg-type]

    def render(self, messages: Sequence[dict[str, Any]],
               add_generation_prompt: bool = True) -> str:
        return str(self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens))


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None

"""The model as the frontend sees it without running it: name, vocabulary and tokenizer.

A backend whose engines run elsewhere (`DisaggBackend`) still tokenizes in the frontend, so the
Conductor can hash the prompt's blocks before anything is sent. `ModelFront` carries that part
of the `Backend` contract (frontend/backend.py); `max_model_len` is left to the subclass (it is the
workers' setting).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcake.engine.chat_template import ChatTemplate
from kvcake.engine.loader import resolve
from kvcake.server.frontend.protocol import render_chat_text


class ModelFront:
    def __init__(self, model: str, served_model_names: Sequence[str] = ()) -> None:
        source = resolve(model)  # config and tokenizer files only: no weights are loaded
        self._model_config = source.config
        self._tokenizer = source.tokenizer
        # The model's own chat template (compiled once), else the built-in one.
        self._chat_template = ChatTemplate.load(source.directory) if source.directory else None
        self.served_model_names = tuple(served_model_names) or (source.config.name,)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def vocab_size(self) -> int:
        return self._model_config.vocab_size

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer.json; send token ids instead "
                             "of text")
        return self._tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return "" if self._tokenizer is None else self._tokenizer.decode(list(token_ids))

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The prompt's token ids: the model's template rendered as transformers'
        `apply_chat_template` does (special tokens written by the template, none added)."""
        if self._chat_template is None:
            return self.encode(render_chat_text(messages))
        if self._tokenizer is None:
            raise ValueError("messages: this model has no tokenizer.json; use /v1/completions "
                             "with token ids")
        text = self._chat_template.render([{"role": r, "content": c} for r, c in messages])
        return self._tokenizer.encode(text, add_special_tokens=False)

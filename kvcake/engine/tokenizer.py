"""Tokenizers: a byte-level one for presets, and `tokenizer.json` read with `tokenizers`."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kvcake.engine.config import BYTE_BOS_ID, BYTE_EOS_ID


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; 256 is BOS (prepended by `encode`), 257 is EOS."""

    bos_token_id = BYTE_BOS_ID
    eos_token_id = BYTE_EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BYTE_BOS_ID, *text.encode("utf-8")] if add_special_tokens \
            else list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (special tokens such as BOS added as it configures)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ValueError(f"model: {path} is not a valid tokenizer.json ({exc})") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids))

"""What the HTTP API reads from a client before it spends real work on a request.

Three caps, each checked before the step it protects:
- the request body (`max_request_bytes`): a declared `Content-Length` over the cap is refused
  before any byte is read, a chunked body as soon as it passes the cap (413);
- the JSON nesting depth (`max_json_depth`), before the body is parsed (400);
- a text prompt's characters (`max_prompt_chars`), before it is tokenized (400). The default is
  `PROMPT_CHARS_PER_TOKEN` characters per token of the model's maximum length: a prompt longer
  than that cannot fit unless its tokens average more than that many characters, which only
  degenerate text does (raise the cap for such prompts).

Pure: no I/O here; the API (`api.py`) applies the checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PROMPT_CHARS_PER_TOKEN = 16

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = 8 * 2**20
    max_json_depth: int = 64
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x the max model length

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if self.max_json_depth < 2:
            raise ValueError(f"max_json_depth: must be >= 2 (a request object holding a list),"
                             f" got {self.max_json_depth}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars: must be >= 1, got {self.max_prompt_chars}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "limits") -> HttpLimits:
        from kvcake.units import parse_size

        known = {"max_request_bytes", "max_json_depth", "max_prompt_chars"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known keys are {sorted(known)}")
        values = dict(raw)
        if isinstance(values.get("max_request_bytes"), str):
            values["max_request_bytes"] = parse_size(values["max_request_bytes"],
                                                     "max_request_bytes")
        return cls(**values)

    def prompt_chars(self, max_model_len: int) -> int:
        """The most characters a text prompt may have before it is tokenized."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return PROMPT_CHARS_PER_TOKEN * max_model_len


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """True when the JSON text `body` nests arrays/objects deeper than `limit`.

    C-speed passes (no Python loop per byte): strings are cut out, every byte but the brackets
    dropped, then the innermost `[]`/`{}` pairs removed one level per pass, at most `limit` + 1
    passes (skipped when the body holds no more brackets than `limit`). Text that is not valid JSON may come out either way; the parser that
    runs next reports it.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        if not brackets:
            return False
        shorter = _strip_innermost(brackets)
        if len(shorter) == len(brackets):  # unbalanced: not JSON, the parser will say so
            return False
        brackets = shorter
    return len(_strip_innermost(brackets)) < len(brackets)


def _strip_innermost(brackets: bytes) -> bytes:
    """`brackets` without its innermost pairs: exactly one level (a marker keeps `{[]}` from
    losing both levels in one pass)."""
    return brackets.replace(b"[]", b"\0").replace(b"{}", b"\0").replace(b"\0", b"")

"""Streamed text: a linear incremental detokenizer and stop strings over it.

`IncrementalDetokenizer` decodes only a short window per push (the tokens since the last emitted
text, with a few tokens before them as context, as Hugging Face's streamers and vLLM do), so a
long output costs O(length), not O(length^2). A tail that decodes to an incomplete UTF-8
character (U+FFFD) is held back until the next tokens complete it (for 4 tokens at most, or until
the output ends).

`TextStream` adds OpenAI `stop` strings: the text is withheld while it could still be the start
of a stop string, and when one appears the output ends before it (the stop text itself is never
sent), also when it spans several pushes (stream chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_CONTEXT_TOKENS = 5  # tokens decoded before the new ones, so word-boundary spaces come out right


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self._prefix = 0  # window start: context tokens already emitted
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        window = self.token_ids[self._prefix:]
        before = self._decode(self.token_ids[self._prefix:self._read]) if self._read > \
            self._prefix else ""
        text = self._decode(window)
        if text.endswith("\ufffd") and not final and len(self.token_ids) - self._read < 4:
            return ""  # an incomplete character: wait (4 tokens at most) for the rest of it
        new = text[len(before):]
        self._read = len(self.token_ids)
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        return new


class TextStream:
    """New text per push, with `stop` strings applied; `stopped` once one matched."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # text withheld: it may begin a stop string
        self.stopped = False

    @property
    def token_ids(self) -> list[int]:
        return self._detok.token_ids

    def push(self, token_ids: Sequence[int], final: bool) -> str:
        if self.stopped:
            return ""
        text = self._pending + self._detok.push(token_ids, final)
        if not self._stop:
            self._pending = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        if final:
            self._pending = ""
            return text
        keep = min(self._hold, len(text))
        # hold back only a tail that could still begin a stop string
        while keep and not any(s.startswith(text[len(text) - keep:]) for s in self._stop):
            keep -= 1
        self._pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

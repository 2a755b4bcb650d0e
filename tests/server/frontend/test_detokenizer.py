"""The streamed-text detokenizer: linear work, the same text as one decode, stop strings."""

from __future__ import annotations

import pytest

from kvcake.engine.tokenizer import ByteTokenizer
from kvcake.server.frontend.detokenizer import IncrementalDetokenizer, TextStream

TOK = ByteTokenizer()
TEXT = "héllo wörld, ünïcode — and ascii " * 8


class CountingDecode:
    def __init__(self) -> None:
        self.tokens_decoded = 0

    def __call__(self, ids: list[int]) -> str:
        self.tokens_decoded += len(ids)
        return TOK.decode(ids)


def test_one_token_at_a_time_equals_one_decode_and_is_linear() -> None:
    ids = TOK.encode(TEXT, add_special_tokens=False)
    decode = CountingDecode()
    detok = IncrementalDetokenizer(decode)
    out = "".join(detok.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert out == TEXT
    # a bounded window per token, not the whole output again (that would be ~len(ids)^2 / 2)
    assert decode.tokens_decoded < 20 * len(ids) < len(ids) ** 2 / 2


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stop_string_across_chunks_is_withheld(chunk: int) -> None:
    text = "abc STOP here"
    ids = TOK.encode(text, add_special_tokens=False)
    stream = TextStream(TOK.decode, stop=("STOP", "zz"))
    parts = []
    for i in range(0, len(ids), chunk):
        parts.append(stream.push(ids[i:i + chunk], final=i + chunk >= len(ids)))
        if stream.stopped:
            break
    assert "".join(parts) == "abc "
    assert stream.stopped and all("S" not in p for p in parts)


def test_a_tail_that_is_not_a_stop_prefix_is_not_held() -> None:
    stream = TextStream(TOK.decode, stop=("xyz",))
    assert stream.push(TOK.encode("abc", add_special_tokens=False), final=False) == "abc"
    assert stream.push(TOK.encode("ax", add_special_tokens=False), final=False) == "a"
    assert stream.push(TOK.encode("q", add_special_tokens=False), final=True) == "xq"
    assert not stream.stopped


def test_a_split_character_is_held_until_complete() -> None:
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    euro = "€".encode()  # three bytes
    assert stream.push((ord("a"),), final=False) == "a"
    assert stream.push((euro[0],), final=False) == ""
    assert stream.push((euro[1],), final=False) == ""
    assert stream.push((euro[2],), final=False) == "€"
    assert stream.push((0xFF,), final=True) == "\ufffd"  # invalid byte: flushed at the end

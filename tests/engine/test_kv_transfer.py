"""Block KV export/import, KV events, and the disaggregation hooks (prefill-only, decode with KV)."""

from __future__ import annotations

import pytest
import torch

from kvcake.engine.block_manager import KvEventKind
from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.sampling import SamplingParams
from kvcake.engine.sequence import FinishReason

from .conftest import SMALL_POOL

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPT = [int(x) for x in torch.randint(0, 256, (53,), generator=torch.Generator().manual_seed(9))]


def _drain(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_kv_events_and_export_import_between_instances() -> None:
    src = Engine("tiny", SMALL_POOL)
    src.add_request("a", PROMPT, GREEDY)
    ref = _drain(src)["a"]
    keys = src.prompt_block_keys(PROMPT)
    assert len(keys) == 3
    events = src.drain_kv_events()
    assert [e.key for e in events[:3]] == keys
    assert {e.kind for e in events} == {KvEventKind.STORED}
    assert src.num_cached_tokens(PROMPT) == 48

    dst = Engine("tiny", SMALL_POOL)
    assert dst.namespace == src.namespace
    assert dst.num_cached_tokens(PROMPT) == 0 and dst.export_block_kv(keys[0]) is None
    blobs = [src.export_block_kv(k) for k in keys]
    assert all(b is not None and len(b) == dst.pool.block_nbytes for b in blobs)
    for k, b in zip(keys, blobs, strict=True):
        assert b is not None and dst.import_block_kv(k, b) is True
    assert dst.import_block_kv(keys[0], blobs[0] or b"") is False  # already cached
    assert dst.drain_kv_events() == events[:3]
    assert dst.num_cached_tokens(PROMPT) == 48
    assert [dst.export_block_kv(k) for k in keys] == blobs
    dst.add_request("b", PROMPT, GREEDY)
    first = dst.step()
    assert first[0].num_cached_tokens == 48
    assert first[0].new_token_ids + _drain(dst)["b"] == ref


def test_import_rejects_wrong_size_and_changes_nothing() -> None:
    engine = Engine("tiny", SMALL_POOL)
    key = engine.prompt_block_keys(PROMPT)[0]
    with pytest.raises(ValueError, match="kv bytes: one block is"):
        engine.import_block_kv(key, b"\0" * 10)
    assert engine.num_cached_tokens(PROMPT) == 0 and engine.drain_kv_events() == []


def test_prefill_only_then_decode_with_kv_equals_colocated() -> None:
    colocated = LLM("tiny", SMALL_POOL).generate([PROMPT], GREEDY)[0].token_ids
    prefill = Engine("tiny", SMALL_POOL)
    prefill.add_request("p", PROMPT, GREEDY, prefill_only=True)
    streamed: dict[int, list[bytes]] = {}

    def on_layer(layer_idx: int) -> None:  # stream each layer as soon as it is written
        blocks = prefill.request_block_ids("p")
        streamed[layer_idx] = [prefill.export_layer_kv(b, layer_idx) for b in blocks]

    [out] = prefill.step(layer_hook=on_layer)
    assert out.finished and out.finish_reason is FinishReason.PREFILL_DONE
    assert out.new_token_ids == colocated[:1]
    assert sorted(streamed) == list(range(prefill.model_config.num_layers))
    held = prefill.request_block_ids("p")
    assert len(held) == 4 and all(prefill.block_manager.ref_count(b) == 1 for b in held)
    kv_blocks = [b"".join(streamed[layer][i] for layer in sorted(streamed)) for i in range(4)]
    prefill.release("p")
    assert all(prefill.block_manager.ref_count(b) == 0 for b in held)

    decode = Engine("tiny", SMALL_POOL)
    decode.add_request("other", [7, 8, 9], GREEDY)
    decode.step()
    assert decode.add_request_with_kv("d", PROMPT, out.new_token_ids[0], kv_blocks, GREEDY)
    got = _drain(decode)
    assert out.new_token_ids + got["d"] == colocated
    assert len(got["other"]) == 9


def test_abort_frees_blocks_and_is_idempotent() -> None:
    engine = Engine("tiny", SMALL_POOL)
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks == engine.num_blocks - 4
    engine.abort("a")
    engine.abort("a")
    engine.abort("never-seen")
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.num_blocks

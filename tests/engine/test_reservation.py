"""Disaggregation: seeded sampler state hand-off, and decode-side block reservation for direct
KV writes (reserve -> remote writes into the pool -> commit; cancel; no room)."""

from __future__ import annotations

import pytest
import torch

from kvcake.engine.block_manager import KvEventKind
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.sampling import SamplingParams
from kvcake.engine.sequence import FinishReason
from kvcake.types import BlockId

from .conftest import SMALL_POOL

SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPT = [int(x) for x in torch.randint(0, 256, (53,), generator=torch.Generator().manual_seed(9))]


def _drain(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _prefill(params: SamplingParams) -> tuple[Engine, int, list[list[bytes]]]:
    """Prefill-only on a fresh engine: (engine, first token, per-block per-layer KV bytes)."""
    engine = Engine("tiny", SMALL_POOL)
    engine.add_request("p", PROMPT, params, prefill_only=True)
    [out] = engine.step()
    assert out.finish_reason is FinishReason.PREFILL_DONE
    layers = range(engine.model_config.num_layers)
    kv = [[engine.export_layer_kv(b, i) for i in layers] for b in engine.request_block_ids("p")]
    return engine, out.new_token_ids[0], kv


def test_seeded_sampling_survives_disaggregation_with_sampler_state() -> None:
    colocated = LLM("tiny", SMALL_POOL).generate([PROMPT], SEEDED)[0].token_ids
    prefill, first, kv = _prefill(SEEDED)
    assert first == colocated[0]
    state = prefill.sampler_state("p")
    assert isinstance(state, bytes)
    prefill.release("p")
    assert prefill.sampler_state("p") is None  # released with the blocks
    blocks = [b"".join(layers) for layers in kv]

    decode = Engine("tiny", SMALL_POOL)
    decode.add_request("other", [7, 8, 9], SamplingParams(max_tokens=5, temperature=1.0))
    decode.step()
    assert decode.add_request_with_kv("d", PROMPT, first, blocks, SEEDED, sampler_state=state)
    assert [first, *_drain(decode)["d"]] == colocated

    # Without the state the decode side restarts the seed: different tokens (the test can fail).
    fresh = Engine("tiny", SMALL_POOL)
    assert fresh.add_request_with_kv("d", PROMPT, first, blocks, SEEDED)
    assert [first, *_drain(fresh)["d"]] != colocated


def test_greedy_and_unseeded_requests_have_no_sampler_state() -> None:
    prefill, _, _ = _prefill(GREEDY)
    assert prefill.sampler_state("p") is None
    assert prefill.sampler_state("never-seen") is None


def test_bad_sampler_state_is_rejected_and_changes_nothing() -> None:
    _, first, kv = _prefill(SEEDED)
    blocks = [b"".join(layers) for layers in kv]
    decode = Engine("tiny", SMALL_POOL)
    free = decode.block_manager.free_block_ids()
    with pytest.raises(ValueError, match="sampler_state: 3 bytes are not a generator state"):
        decode.add_request_with_kv("d", PROMPT, first, blocks, SEEDED, sampler_state=b"abc")
    with pytest.raises(ValueError, match="sampler_state: only seeded requests"):
        decode.add_request_with_kv("d", PROMPT, first, blocks, GREEDY, sampler_state=b"abc")
    assert decode.block_manager.free_block_ids() == free and not decode.has_unfinished()
    assert decode.drain_kv_events() == []
    assert decode.add_request_with_kv("d", PROMPT, first, blocks, GREEDY)  # id still free


def _write_direct(decode: Engine, block_ids: list[BlockId], kv: list[list[bytes]]) -> None:
    """A remote writer: put each layer at the documented byte offset of the pool's memory."""
    flat = decode.pool.kv.view(-1).view(torch.uint8)
    n = decode.pool.layer_nbytes
    first_block = len(kv) - len(block_ids)
    for block, layers in zip(block_ids, kv[first_block:], strict=True):
        for layer_idx, data in enumerate(layers):
            off = decode.pool.layer_offset_bytes(block, layer_idx)
            flat[off:off + n] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_reserve_direct_write_commit_equals_colocated() -> None:
    colocated = LLM("tiny", SMALL_POOL).generate([PROMPT], SEEDED)[0].token_ids
    prefill, first, kv = _prefill(SEEDED)
    decode = Engine("tiny", SMALL_POOL)
    free_before = decode.block_manager.num_free_blocks
    to_fill = decode.reserve_request("d", PROMPT, SEEDED)
    assert to_fill is not None and len(to_fill) == 4  # nothing cached: all 4 prompt blocks
    assert decode.request_block_ids("d")[:4] == to_fill
    assert decode.block_manager.num_free_blocks == free_before - 4  # 53 + 1 tokens: 4 blocks
    assert not decode.has_unfinished() and decode.drain_kv_events() == []  # nothing keyed yet
    _write_direct(decode, to_fill, kv)
    decode.commit_reserved("d", first, prefill.sampler_state("p"))
    assert [e.kind for e in decode.drain_kv_events()] == [KvEventKind.STORED] * 3
    assert [first, *_drain(decode)["d"]] == colocated


def test_reserve_reuses_cached_prefix_blocks_and_asks_only_for_the_rest() -> None:
    colocated = LLM("tiny", SMALL_POOL).generate([PROMPT], GREEDY)[0].token_ids
    _, first, kv = _prefill(GREEDY)
    decode = Engine("tiny", SMALL_POOL)
    decode.add_request("warm", PROMPT[:48] + [1, 2], SamplingParams(max_tokens=1))
    _drain(decode)  # the first 3 blocks of PROMPT are now cached here
    to_fill = decode.reserve_request("d", PROMPT, GREEDY)
    assert to_fill is not None and len(to_fill) == 1
    table = decode.request_block_ids("d")
    assert table[3] == to_fill[0] and all(decode.block_manager.ref_count(b) == 1 for b in table)
    _write_direct(decode, to_fill, kv)
    decode.commit_reserved("d", first)
    assert [first, *_drain(decode)["d"]] == colocated


def test_cancel_frees_exactly_the_reserved_blocks() -> None:
    decode = Engine("tiny", SMALL_POOL)
    decode.add_request("warm", PROMPT[:32], SamplingParams(max_tokens=1))
    _drain(decode)
    decode.drain_kv_events()
    free_before = decode.block_manager.free_block_ids()
    to_fill = decode.reserve_request("d", PROMPT, GREEDY)
    assert to_fill is not None and len(to_fill) == 2  # blocks 0-1 reused from the cache
    held = decode.request_block_ids("d")
    assert len(held) == 4 and set(held) & set(decode.block_manager.free_block_ids()) == set()
    decode.cancel_reserved("d")
    decode.cancel_reserved("d")  # idempotent
    assert sorted(decode.block_manager.free_block_ids()) == sorted(free_before)
    assert all(decode.block_manager.ref_count(b) == 0 for b in held)
    assert decode.num_cached_tokens(PROMPT) == 32 and decode.drain_kv_events() == []
    with pytest.raises(ValueError, match="request_id: 'd' has no reservation"):
        decode.commit_reserved("d", 5)
    # abort() cancels a reservation too, and the id is reusable.
    assert decode.reserve_request("d", PROMPT, GREEDY) is not None
    decode.abort("d")
    assert sorted(decode.block_manager.free_block_ids()) == sorted(free_before)


def test_no_room_returns_none_and_changes_nothing() -> None:
    decode = Engine("tiny", EngineConfig(num_blocks=6, device="cpu"))
    decode.add_request("busy", list(range(40)), GREEDY)  # 3 blocks held
    decode.step()
    free = decode.block_manager.free_block_ids()
    events = decode.drain_kv_events()
    assert decode.reserve_request("d", PROMPT, GREEDY) is None  # needs 4 blocks, 3 free
    assert decode.block_manager.free_block_ids() == free and decode.drain_kv_events() == []
    assert decode.add_request_with_kv("d", PROMPT, 1, [b"\0" * decode.pool.block_nbytes] * 4,
                                      GREEDY) is False
    assert decode.block_manager.free_block_ids() == free
    out = _drain(decode)
    assert len(out["busy"]) == 9 and events  # still serving (1 token came earlier); now room
    assert decode.reserve_request("d", PROMPT, GREEDY) is not None


def test_reservation_bad_input_is_a_clear_error() -> None:
    decode = Engine("tiny", SMALL_POOL)
    with pytest.raises(ValueError, match="max_tokens: must be >= 2"):
        decode.reserve_request("d", PROMPT, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt: the prompt is empty"):
        decode.reserve_request("d", [], GREEDY)
    assert decode.reserve_request("d", PROMPT, GREEDY) is not None
    with pytest.raises(ValueError, match="request_id: 'd' is already in use"):
        decode.reserve_request("d", PROMPT, GREEDY)
    with pytest.raises(ValueError, match=r"first_token_id: 512 is outside the vocabulary"):
        decode.commit_reserved("d", 512)
    decode.commit_reserved("d", 5)  # the reservation survived the bad commit
    assert len(_drain(decode)["d"]) == 9
    with pytest.raises(ValueError, match="kv address: block"):
        decode.pool.layer_offset_bytes(BlockId(decode.num_blocks), 0)

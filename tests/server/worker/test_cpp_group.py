"""A live CPP group: 2 members (threads here; processes in benchmarks/cpp_prefill.py) (layer slices, hidden states through a shared-memory
transfer segment, chunks pipelined), each streaming its layers' KV into a decode engine's
reserved blocks; the first token and the decoded continuation equal the single engine's."""

from __future__ import annotations

import pytest
import torch

from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.sampling import SamplingParams
from kvcake.server.worker.cpp_group import CppGroup, CppGroupConfig
from kvcake.server.worker.cpp_stage import KvTarget, chunks
from kvcake.server.worker.decode import pool_allocator
from kvcake.transfer import TransferConfig, TransferEngine

CONFIG = EngineConfig(kv_cache_bytes=4 * 2**20, device="cpu")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = [int(x) for x in torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(4))]


def _tokens(engine: Engine) -> list[int]:
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def test_chunks() -> None:
    assert chunks(5, 2) == [(0, 2), (2, 2), (4, 1)]
    with pytest.raises(ValueError, match=">= 1"):
        chunks(5, 0)


def test_group_tokens_equal_single_engine() -> None:
    single = Engine("tiny", CONFIG)
    single.add_request("r", PROMPT, GREEDY)
    expected = _tokens(single)
    assert len(set(expected)) > 2
    with TransferEngine(TransferConfig(port=0)) as transfer:
        decode = Engine("tiny", CONFIG, kv_allocator=pool_allocator(transfer, "d0", shared=True))
        targets = decode.reserve_request("r", PROMPT, GREEDY)
        assert targets is not None and len(targets) == 10
        target = KvTarget(transfer.describe("kv-pool-d0").to_dict(), decode.num_blocks,
                          tuple(targets))
        with CppGroup("tiny", 2, CONFIG, CppGroupConfig(chunk_tokens=40, in_process=True)) as group:  # 4 chunks
            result = group.prefill("r", PROMPT, max_tokens=GREEDY.max_tokens, kv_target=target)
        decode.commit_reserved("r", result.first_token)
        out = [result.first_token] + _tokens(decode)
    assert out == expected
    # Each member streamed its own 2 layers of the blocks each chunk touched (a block a chunk
    # left partial goes again with the next one): 3 blocks per 40-token chunk here.
    touched = sum(-(-(s + n) // 16) - s // 16 for s, n in chunks(len(PROMPT), 40))
    assert touched == 12
    assert result.kv_bytes == (2 * touched * decode.pool.layer_nbytes,) * 2


def test_three_members_one_slot_each_back_pressure() -> None:
    """One inbox slot per member: every chunk waits for the next member to free it."""
    single = Engine("tiny", CONFIG)
    single.add_request("long", PROMPT, SamplingParams(max_tokens=1))
    single.add_request("short", PROMPT[:20], SamplingParams(max_tokens=1))
    expected = {o.request_id: o.new_token_ids[0] for _ in range(3) for o in single.step()}
    with CppGroup("tiny", 3, CONFIG, CppGroupConfig(chunk_tokens=32, slots=1, in_process=True)) as group:
        assert group.prefill("a", PROMPT).first_token == expected["long"]
        assert group.prefill("b", PROMPT[:20]).first_token == expected["short"]  # one chunk
        assert group.prefill("c", PROMPT).first_token == expected["long"]  # blocks released


def test_members_reuse_a_prefix_from_whole_stored_blocks() -> None:
    """Each member keeps its layers of the prefix's whole blocks (the store's format), writes
    them into the decode engine's blocks, and the chunks start after the prefix: the first
    token and the decoded continuation equal the single engine's on the whole prompt."""
    from kvcake.engine.stage import StageEngine, split_layers
    from kvcake.server.worker.cpp_stage import CppBegin, CppChunk, CppMember

    single = Engine("tiny", CONFIG)
    single.add_request("r", PROMPT, GREEDY)
    expected = _tokens(single)
    blocks = [single.export_block_kv(k) for k in single.prompt_block_keys(PROMPT)[:6]]
    assert all(b is not None for b in blocks)  # 96 tokens of 150, as the store holds them
    with TransferEngine(TransferConfig(port=0)) as transfer:
        decode = Engine("tiny", CONFIG, kv_allocator=pool_allocator(transfer, "d1", shared=True))
        targets = decode.reserve_request("r", PROMPT, GREEDY)
        assert targets is not None
        target = KvTarget(transfer.describe("kv-pool-d1").to_dict(), decode.num_blocks,
                          tuple(targets))
        members = [CppMember(StageEngine("tiny", span, CONFIG), transfer, member=m,
                             chunk_tokens=40, tag=f"prefix-{m}")
                   for m, span in enumerate(split_layers(4, 2))]
        token = None
        for m in members:
            assert m.begin(CppBegin("r", tuple(PROMPT), GREEDY.max_tokens, target), GREEDY)
            m.import_prefix("r", [bytearray(b) for b in blocks if b is not None])
            m.stream_prefix("r", 6)
        for start, n in chunks(len(PROMPT) - 96, 40):  # 96..135, 136..149
            hidden = members[0].compute(CppChunk("r", 96 + start, n, -1))
            assert isinstance(hidden, torch.Tensor)
            members[0].write_hidden(hidden, 0, members[1].inbox)
            token = members[1].compute(CppChunk("r", 96 + start, n, 0))
        for m in members:
            m.finish("r")
        assert isinstance(token, int)
        decode.commit_reserved("r", token)
        out = [token] + _tokens(decode)
    assert out == expected
    with pytest.raises(ValueError, match="a block is"):
        members[0].begin(CppBegin("s", tuple(PROMPT), 1), GREEDY)
        members[0].import_prefix("s", [bytearray(10)])

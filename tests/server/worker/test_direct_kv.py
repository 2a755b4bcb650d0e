"""The direct KV path between two workers driven over their control links: the prefill worker
writes the prompt KV straight into the blocks the decode engine reserved (no copy on d)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcake import LLM, SamplingParams
from kvcake.engine.config import EngineConfig
from kvcake.hashing import block_keys
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.link import MessageLink
from kvcake.server.worker.messages import (
    Abort,
    DecodeAdmitted,
    DecodeOrder,
    Hello,
    KvReserved,
    PrefillDone,
    PrefillOrder,
    RequestFailed,
    ReserveKv,
    Tokens,
)
from kvcake.server.worker.worker import Worker
from tests.server.worker.links import next_of

ENGINE = EngineConfig(kv_cache_bytes=4 * 2**20)
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_prefill_writes_into_the_reserved_decode_blocks() -> None:
    prompt = np.random.default_rng(5).integers(0, 256, 40).tolist()  # 3 blocks of 16
    with Worker(WorkerConfig(role=Role.DECODE, engine=ENGINE, worker_id="d0")) as decode, \
            Worker(WorkerConfig(role=Role.PREFILL, engine=ENGINE, worker_id="p0")) as prefill:
        assert decode.engine is not None and decode.transfer is not None
        d_link, p_link = MessageLink.connect(decode.address), MessageLink.connect(prefill.address)
        try:
            d_hello, p_hello = next_of(d_link, Hello), next_of(p_link, Hello)
            assert (d_hello.worker_id, d_hello.role, p_hello.worker_id, p_hello.role) == \
                ("d0", "decode", "p0", "prefill")
            assert d_hello.num_blocks == decode.engine.pool.num_blocks
            with pytest.raises(KeyError):  # no staging segment besides the pool any more
                decode.transfer.segment("kv-staging-d0")
            d_link.send(ReserveKv("r", prompt, SAMPLING))
            reserved = next_of(d_link, KvReserved)
            assert reserved.request_id == "r" and len(reserved.block_ids) == 3
            assert reserved.kv_pool["name"] == "kv-pool-d0"
            assert reserved.num_pool_blocks == decode.engine.pool.num_blocks
            pool = decode.engine.pool.kv
            pool[:, reserved.block_ids] = float("nan")  # only the transfer can make them finite
            p_link.send(PrefillOrder("r", prompt, SAMPLING, [], reserved.kv_pool,
                                     reserved.block_ids, reserved.num_pool_blocks))
            done = next_of(p_link, PrefillDone, RequestFailed)
            assert isinstance(done, PrefillDone), done
            assert (done.request_id, done.num_cached_tokens) == ("r", 0)
            assert done.transfer_bytes == 3 * decode.engine.pool.block_nbytes
            assert bool(torch.isfinite(pool[:, reserved.block_ids]).all())
            d_link.send(DecodeOrder("r", prompt, done.first_token_id, SAMPLING,
                                    done.sampler_state))
            assert next_of(d_link, DecodeAdmitted, RequestFailed) == DecodeAdmitted("r")
            generated = [done.first_token_id]
            while True:
                tokens = next_of(d_link, Tokens)
                assert tokens.request_id == "r"
                generated += tokens.token_ids
                if tokens.finish_reason is not None:
                    break
            # d decoded from the reserved blocks themselves: its prefix cache holds the prompt's
            # full blocks there (read once the request ended, so no race with its decode steps).
            keys = block_keys(prompt, decode.engine.block_size, decode.engine.namespace)
            assert [decode.engine.block_manager.lookup(k) for k in keys] == \
                reserved.block_ids[:2]
        finally:
            d_link.close()
            p_link.close()
    llm = LLM("tiny", config=ENGINE)
    offline = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert generated == offline[0].token_ids


def reserve_four_blocks(decode: Worker, link: MessageLink) -> int:
    """After the worker's Hello, reserve request "a" (50 tokens: 4 blocks); returns the number
    of free blocks before the reservation."""
    assert next_of(link, Hello).worker_id == decode.worker_id and decode.engine is not None
    free = decode.engine.block_manager.num_free_blocks
    link.send(ReserveKv("a", list(range(50)), SAMPLING))
    reserved = next_of(link, KvReserved)
    assert reserved.request_id == "a" and len(reserved.block_ids) == 4
    return free


def test_an_aborted_reservation_frees_its_blocks() -> None:
    with Worker(WorkerConfig(role=Role.DECODE, engine=ENGINE, worker_id="d1")) as decode:
        assert decode.engine is not None
        link = MessageLink.connect(decode.address)
        try:
            free = reserve_four_blocks(decode, link)
            link.send(DecodeOrder("b", list(range(5)), 1, SAMPLING))
            assert next_of(link, RequestFailed) == RequestFailed(
                "b", "decode refused: no reserved KV blocks")
            link.send(Abort("a"))
            link.send(ReserveKv("c", list(range(50)), {"max_tokens": 1}))
            failed = next_of(link, RequestFailed)
            assert failed.request_id == "c" and "max_tokens: must be >= 2" in failed.message
            assert decode.engine.block_manager.num_free_blocks == free
        finally:
            link.close()


def test_a_reservation_kept_for_a_lost_writer_is_freed_once_it_is_dead() -> None:
    with Worker(WorkerConfig(role=Role.DECODE, engine=ENGINE, worker_id="d2")) as decode:
        assert decode.engine is not None
        link = MessageLink.connect(decode.address)
        try:
            free = reserve_four_blocks(decode, link)
            link.send(Abort("a", keep_reserved=True))  # the writer may be hung: kept
            link.send(ReserveKv("c", list(range(50)), {"max_tokens": 1}))  # a round trip
            assert next_of(link, RequestFailed).request_id == "c"
            assert decode.engine.block_manager.num_free_blocks == free - 4
            link.send(Abort("a"))  # the frontend reaped the writer: the blocks are free again
            link.send(ReserveKv("e", list(range(50)), {"max_tokens": 1}))
            assert next_of(link, RequestFailed).request_id == "e"
            assert decode.engine.block_manager.num_free_blocks == free
        finally:
            link.close()

"""Chunked pipeline parallelism served live (tiny preset, workers in this process): a cluster of
1 plain prefill worker, 1 decode worker and a CPP group of 2 stages (each a slice of the layers,
hidden states through a shared-memory inbox, chunks of 40 tokens). A prompt of `cpp_min_tokens`
or more is prefilled by the group, a shorter one by the plain worker; the greedy tokens equal
the offline engine's either way."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator

import pytest

from kvcake import LLM, SamplingParams
from kvcake.conductor import ConductorConfig
from kvcake.server.cluster.backend import DisaggBackend
from kvcake.server.cluster.config import ClusterConfig
from kvcake.server.cluster.launcher import Cluster
from kvcake.server.frontend.backend import GenerateRequest, TokenEvent
from kvcake.server.worker.cpp_role import CppRole
from kvcake.server.worker.worker import Worker
from kvcake.types import RequestId
from tests.server.test_disagg import (
    ENGINE,
    WORKER,
    ids,
    offline,
    profile_dir,
    run,
    store_blocks,
    tokens,
    wait_until,
)

CHUNK = 40
CPP = {"admission": "none", "cpp_min_tokens": 100, "cpp_nodes": 2, "cpp_chunk_tokens": CHUNK,
       "cpp_min_chunk_tokens": 16}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = ClusterConfig.simple(1, 1, 2, engine=ENGINE, worker=dict(WORKER),
                                  conductor=ConductorConfig.from_dict(CPP),
                                  profile_dir=profile_dir(tmp_path_factory))
    with Cluster(config, in_process=True) as running:
        yield running


@pytest.fixture(scope="module")
def backend(cluster: Cluster) -> DisaggBackend:
    assert cluster.backend is not None
    return cluster.backend


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", config=ENGINE)


def chunks_by_stage(cluster: Cluster) -> list[int]:
    roles = [cluster.workers[w]._role for w in ("cpp-2", "cpp-3")]
    assert all(isinstance(r, CppRole) for r in roles)
    return [r.num_chunks for r in roles]  # type: ignore[union-attr]


def test_stages_hold_their_slice_and_form_the_group(cluster: Cluster,
                                                    backend: DisaggBackend) -> None:
    stages = [cluster.workers[w].stage for w in ("cpp-2", "cpp-3")]
    assert [s.layers if s else None for s in stages] == [range(0, 2), range(2, 4)]
    assert [s.pool.num_layers if s else 0 for s in stages] == [2, 2]
    assert backend.conductor is not None
    assert backend.conductor.cpp_groups == (("cpp-2", "cpp-3"),)


def test_long_prompt_through_the_group_equals_the_single_engine(cluster: Cluster,
                                                                backend: DisaggBackend,
                                                                llm: LLM) -> None:
    prompt = ids(70, 230)  # 6 chunks (5 x 40 + 30), most ending inside a block
    before, bytes_before = chunks_by_stage(cluster), backend.totals.transfer_bytes
    events = run(backend, prompt, 9)
    assert tokens(events) == offline(llm, [prompt], 9)[0]
    assert [a - b for a, b in zip(chunks_by_stage(cluster), before, strict=True)] == [6, 6]
    # Each stage streamed its 2 layers of every block each chunk touched: 3 blocks per chunk
    # (a block a chunk leaves partial goes again with the next one), 18 in all.
    touched = sum(-(-min(s + CHUNK, 230) // 16) - s // 16 for s in range(0, 230, CHUNK))
    assert touched == 18
    layer_nbytes = backend._hello().layer_nbytes
    assert backend.totals.transfer_bytes - bytes_before == touched * 4 * layer_nbytes


def test_short_prompt_takes_the_plain_path(cluster: Cluster, backend: DisaggBackend,
                                           llm: LLM) -> None:
    prompt = ids(71, 60)
    before = chunks_by_stage(cluster)
    assert tokens(run(backend, prompt, 6)) == offline(llm, [prompt], 6)[0]
    assert chunks_by_stage(cluster) == before


def test_concurrent_long_and_short_prompts(cluster: Cluster, backend: DisaggBackend,
                                           llm: LLM) -> None:
    """Two long prompts share the group's inbox slots (back-pressure) while short ones go to
    the plain worker."""
    prompts = [ids(80 + i, n) for i, n in enumerate((300, 40, 150, 99))]
    before = chunks_by_stage(cluster)

    async def all_at_once() -> list[list[int]]:
        async def one(i: int, prompt: list[int]) -> list[int]:
            stream = await backend.generate(GenerateRequest(
                RequestId(f"cpp-batch-{i}"), tuple(prompt), 7, temperature=0.0,
                ignore_eos=True))
            return [t async for e in stream for t in e.token_ids]
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    assert asyncio.run(all_at_once()) == offline(llm, prompts, 7)
    assert [a - b for a, b in zip(chunks_by_stage(cluster), before, strict=True)] == [8 + 4] * 2


def test_a_group_prompt_reaches_the_store_for_later_prompts(backend: DisaggBackend,
                                                            llm: LLM) -> None:
    """No stage holds a whole block: each stage stores its layers of the group's prompt (a slice
    object per block); a later short prompt with that prefix fetches it on the plain worker,
    which puts the slices together."""
    first = ids(90, 230)
    run(backend, first, 4)
    wait_until(lambda: store_blocks(backend, first) == 230 // 16)
    second = first[:96] + ids(91, 3)  # below cpp_min_tokens: the plain prefill worker
    events = run(backend, second, 6)
    assert events[0].num_cached_tokens == 96  # 6 blocks fetched from the store
    assert tokens(events) == offline(llm, [second], 6)[0]


def test_a_prompt_only_request_through_the_group_stores_its_prefix(cluster: Cluster,
                                                                    backend: DisaggBackend,
                                                                    llm: LLM) -> None:
    """max_tokens 1: the request ends at the group's first token and never reaches a decode
    worker, yet its prompt is stored (each stage its layers of the 14 full blocks) and a later
    prompt sharing 160 tokens reuses them: its greedy tokens equal the engine's."""
    roles = [cluster.workers[w]._role for w in ("cpp-2", "cpp-3")]
    stored = [r.store_writer.num_stored for r in roles]  # type: ignore[union-attr]
    first = ids(97, 230)
    assert tokens(run(backend, first, 1)) == offline(llm, [first], 1)[0]
    wait_until(lambda: store_blocks(backend, first) == 230 // 16)
    assert [r.store_writer.num_stored - n  # type: ignore[union-attr]
            for r, n in zip(roles, stored, strict=True)] == [14, 14]
    second = first[:160] + ids(98, 70)
    events = run(backend, second, 6)
    assert events[0].num_cached_tokens == 160
    assert tokens(events) == offline(llm, [second], 6)[0]


def generate(backend: DisaggBackend, rid: str, prompt: list[int], **sampling: object) -> list[int]:
    async def go() -> list[int]:
        stream = await backend.generate(GenerateRequest(RequestId(rid), tuple(prompt),
                                                        **sampling))  # type: ignore[arg-type]
        return [t async for e in stream for t in e.token_ids]
    return asyncio.run(go())


def test_seeded_sampling_continues_exactly_after_the_group(backend: DisaggBackend,
                                                          llm: LLM) -> None:
    prompt = ids(100, 170)
    got = generate(backend, "cpp-seeded", prompt, max_tokens=8, temperature=0.9, seed=7,
                   ignore_eos=True)
    want = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.9, seed=7,
                                                 ignore_eos=True))[0].token_ids
    assert got == want


def test_prompt_logprobs_through_the_group_equal_the_engine(cluster: Cluster,
                                                            backend: DisaggBackend,
                                                            llm: LLM) -> None:
    """The last stage scores the prompt's tokens chunk by chunk (150 tokens: 4 chunks of up to
    40); they, the first token's and the tokens equal the offline engine's; the decode blocks
    are freed after."""
    engine = cluster.workers["decode-1"].engine
    assert engine is not None
    prompt = ids(101, 150)

    async def go() -> list[TokenEvent]:
        stream = await backend.generate(GenerateRequest(
            RequestId("cpp-prompt-logprobs"), tuple(prompt), 3, temperature=0.0,
            ignore_eos=True, prompt_logprobs=2))
        return [e async for e in stream]

    events = asyncio.run(go())
    reference = llm.engine
    reference.add_request("ref-prompt-logprobs", prompt,
                          SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2))
    outputs = [o for _ in range(8) for o in reference.step()]
    assert tokens(events) == [t for o in outputs for t in o.new_token_ids]
    got, want = events[0].prompt_logprobs, outputs[0].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) == 150
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g is not None and w is not None
        assert g[0] == w[0] and g[1] == pytest.approx(w[1], abs=1e-4)
        assert [t for t, _ in g[2]] == [t for t, _ in w[2]]
    wait_until(lambda: engine.block_manager.num_free_blocks == engine.pool.num_blocks
               and not backend._flights)


def test_closing_a_group_stream_early_frees_the_decode_blocks(cluster: Cluster,
                                                              backend: DisaggBackend,
                                                              llm: LLM) -> None:
    engine = cluster.workers["decode-1"].engine
    assert engine is not None
    assert len(run(backend, ids(102, 260), 50, close_after=1)) == 1
    wait_until(lambda: engine.block_manager.num_free_blocks == engine.pool.num_blocks
               and not backend._flights)
    prompt = ids(103, 140)
    assert tokens(run(backend, prompt, 4)) == offline(llm, [prompt], 4)[0]


def test_a_restarted_stage_rejoins_and_the_group_serves_again(
        tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> None:
    """Stage 1 stalls with both of its inbox slots full (stage 0 holds a chunk for it), then
    dies: the request fails; a new stage 1 joins and the frontend tells stage 0 its inbox is
    empty, so the next long prompt flows through the group again."""
    config = ClusterConfig.simple(1, 1, 2, engine=ENGINE, worker=dict(WORKER),
                                  conductor=ConductorConfig.from_dict(CPP),
                                  profile_dir=profile_dir(tmp_path_factory))
    with Cluster(config, in_process=True) as running:
        backend = running.backend
        assert backend is not None and backend.conductor is not None
        first, old = running.workers["cpp-2"], running.workers["cpp-3"]
        role = first._role
        assert isinstance(role, CppRole)
        old.hold()
        failures: list[BaseException] = []

        def doomed() -> None:
            try:
                run(backend, ids(110, 230), 4)
            except RuntimeError as exc:
                failures.append(exc)

        thread = threading.Thread(target=doomed)
        thread.start()
        wait_until(lambda: role._parked is not None)  # slots 0 and 1 are stage 1's
        old.close()
        thread.join(timeout=30)
        assert failures and "cpp-3" in str(failures[0])
        assert backend.conductor.cpp_groups == ()
        new = Worker(old.config).start()
        running.workers["cpp-3"] = new  # closed with the cluster
        backend.add_worker(new.address)
        assert backend.conductor.cpp_groups == (("cpp-2", "cpp-3"),)
        wait_until(lambda: len(role._free_next) == 2)
        prompt = ids(111, 230)
        assert tokens(run(backend, prompt, 5)) == offline(llm, [prompt], 5)[0]
        assert isinstance(new._role, CppRole) and new._role.num_chunks == 6


def test_the_last_stage_samples_the_first_token_as_the_engine(backend: DisaggBackend,
                                                             llm: LLM) -> None:
    """min_tokens masks the stop id the greedy first token would be; penalties over the prompt;
    the first token's log probabilities come back with it."""
    prompt = ids(104, 160)
    stop = offline(llm, [prompt], 1)[0][0]
    extras = {"stop_token_ids": (stop,), "min_tokens": 2, "repetition_penalty": 1.3,
              "presence_penalty": 0.4}

    async def go() -> list[TokenEvent]:
        stream = await backend.generate(GenerateRequest(
            RequestId("cpp-extras"), tuple(prompt), 5, temperature=0.0, logprobs=2, **extras))
        return [e async for e in stream]

    events = asyncio.run(go())
    reference = llm.engine
    reference.add_request("ref-extras", prompt, SamplingParams(max_tokens=5, logprobs=2,
                                                               **extras))
    outputs = [o for _ in range(8) for o in reference.step()]
    assert tokens(events) == [t for o in outputs for t in o.new_token_ids]
    assert tokens(events)[0] != stop
    got, want = events[0].logprobs, outputs[0].logprobs
    assert got is not None and want is not None
    assert got[0][0] == want[0][0] == tokens(events)[0]
    assert got[0][1] == pytest.approx(want[0][1], abs=1e-4)
    assert [t for t, _ in got[0][2]] == [t for t, _ in want[0][2]]


def test_a_stage_without_room_holds_the_next_prompt_until_room_frees(
        tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> None:
    """Pools of 26 blocks, two 19-block prompts on two decode workers: stage 0 holds the second
    (it waits, in order) while the first is in the pipeline, then runs it."""
    config = ClusterConfig.simple(1, 2, 2, engine=dataclasses.replace(ENGINE, num_blocks=26),
                                  worker=dict(WORKER), conductor=ConductorConfig.from_dict(CPP),
                                  profile_dir=profile_dir(tmp_path_factory))
    with Cluster(config, in_process=True) as running:
        backend = running.backend
        assert backend is not None
        first, second = running.workers["cpp-3"], running.workers["cpp-4"]
        role = first._role
        assert isinstance(role, CppRole)
        second.hold()  # the first prompt cannot leave the pipeline yet
        prompts = [ids(120, 300), ids(121, 290)]
        got: dict[int, list[int]] = {}

        def one(i: int) -> None:
            got[i] = tokens(run(backend, prompts[i], 4))

        threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(role._waiting) == 1)
        second.release()
        for thread in threads:
            thread.join(timeout=30)
        assert [got.get(0), got.get(1)] == offline(llm, prompts, 4)


def test_a_group_reuses_a_stored_prefix_and_pipelines_only_the_new_tokens(
        tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> None:
    """The first long prompt reaches the store (written by its decode worker); a second one
    sharing its first 160 tokens goes to the other decode worker (empty cache): the Conductor
    plans the fetch, each stage reads its layers of the 10 stored blocks, writes them into the
    decode worker's blocks and computes only the 70 new tokens (2 chunks, not 6)."""
    config = ClusterConfig.simple(1, 2, 2, engine=ENGINE, worker=dict(WORKER),
                                  conductor=ConductorConfig.from_dict(CPP),
                                  profile_dir=profile_dir(tmp_path_factory))
    with Cluster(config, in_process=True) as running:
        backend = running.backend
        assert backend is not None
        roles = [running.workers[w]._role for w in ("cpp-3", "cpp-4")]
        assert all(isinstance(r, CppRole) for r in roles)
        shared = ids(130, 160)
        first, second = shared + ids(131, 70), shared + ids(132, 70)
        backend.set_draining("decode-2", True)
        assert tokens(run(backend, first, 5)) == offline(llm, [first], 5)[0]
        wait_until(lambda: store_blocks(backend, first) == 230 // 16)
        backend.set_draining("decode-2", False)
        backend.set_draining("decode-1", True)
        computed = [r.num_tokens for r in roles]  # type: ignore[union-attr]
        bytes_before = backend.totals.transfer_bytes
        events = run(backend, second, 9)
        assert tokens(events) == offline(llm, [second], 9)[0]
        assert events[0].num_cached_tokens == 160
        assert [r.num_tokens - c  # type: ignore[union-attr]
                for r, c in zip(roles, computed, strict=True)] == [70, 70]
        # Each stage wrote its 2 layers of the 10 prefix blocks and of the blocks its 2 chunks
        # (160..199, 200..229) touched: 3 each (block 12 twice, left partial by the first).
        layer_nbytes = backend._hello().layer_nbytes
        assert backend.totals.transfer_bytes - bytes_before == (10 + 3 + 3) * 4 * layer_nbytes

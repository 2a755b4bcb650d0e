"""The last layer computes only the rows that give logits (CPU fp32 fused path): the sampled
logits and every row's KV must equal the path that computes every row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcake.engine import cpu_ops, model
from kvcake.engine.batcher import BatchPlan, ScheduledChunk
from kvcake.engine.engine import Engine
from kvcake.engine.runner import SAMPLING_ROWS
from kvcake.engine.sequence import Sequence as Seq
from kvcake.types import RequestId

from .conftest import SMALL_POOL

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="kvcake's CPU ops did not build "
                                "(the last-layer trim is on their fused path only)")


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(0, 256, (n,), generator=gen)]


def _sampled_logits(engine: Engine, prompt: list[int], samples_each: bool = False) -> torch.Tensor:
    """The prompt run as `step` runs it (chunks of the token budget, the sampling rows only),
    as `Engine.prompt_logits` runs it for every row: the logits of each chunk's sampling row
    (the last chunk's only, unless `samples_each`)."""
    rid = "__sampled__"
    seq = Seq(RequestId(rid), prompt, len(prompt), 1, engine.block_size, engine.namespace)
    cached = engine.block_manager.allocate(rid, len(prompt), seq.block_keys)
    assert cached is not None
    table = {rid: engine.block_manager.block_ids(rid)}
    parts = []
    budget = engine.config.max_num_batched_tokens
    try:
        for start in range(cached, len(prompt), budget):
            n = min(budget, len(prompt) - start)
            last = start + n == len(prompt)
            plan = BatchPlan([ScheduledChunk(rid, start, n, last or samples_each)])
            parts.append(engine.runner.run(plan, {rid: seq}, table, rows=SAMPLING_ROWS))
        engine.block_manager.cache_full_blocks(rid, seq.block_keys)
    finally:
        engine.block_manager.free(rid)
    return torch.cat(parts)


@pytest.fixture
def query_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The query rows of every prompt-attention call the model makes."""
    calls: list[int] = []
    real = model.paged_prefill_attention

    def spy(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "paged_prefill_attention", spy)
    return calls


@pytest.mark.parametrize("prompt_len", [1, 2, 37, 64, 70])  # 1 token; off / on block and tile
def test_sampled_row_equals_every_row(prompt_len: int, query_rows: list[int]) -> None:
    prompt = _ids(prompt_len, prompt_len)
    ref = Engine("tiny", SMALL_POOL).prompt_logits(prompt)[1][-1]
    query_rows.clear()
    got = _sampled_logits(Engine("tiny", SMALL_POOL), prompt)
    assert got.shape == (1, ref.shape[0])
    assert (got[0] - ref).abs().max().item() < 1e-5
    layers = len(query_rows)  # one call per layer; the last attends the sampled query alone
    assert query_rows == [prompt_len] * (layers - 1) + [1]


def test_kv_of_the_trimmed_layer_serves_a_later_prefix() -> None:
    """The trimmed last layer still writes every row's KV: a prompt that reuses the cached
    prefix gets the cold prompt's logits."""
    prefix, tail = _ids(48, 1), _ids(21, 2)
    warm = Engine("tiny", SMALL_POOL)
    _sampled_logits(warm, prefix)  # caches its 3 full blocks, computed through the trim
    cached, hot = warm.prompt_logits(prefix + tail)
    assert cached == 48
    _, cold = Engine("tiny", SMALL_POOL).prompt_logits(prefix + tail)
    assert (hot - cold[48:]).abs().max().item() < 1e-5


@pytest.mark.parametrize("budget", [7, 33])
def test_chunks_that_do_not_sample_skip_the_last_layer(budget: int,
                                                       query_rows: list[int]) -> None:
    """A chunk without a sampling row computes only its KV in the last layer; the chunk after
    it (and its attention over that KV) gives the unchunked logits."""
    prompt = _ids(90, 5)
    ref = Engine("tiny", SMALL_POOL).prompt_logits(prompt)[1][-1]
    chunked = Engine("tiny", dataclasses.replace(SMALL_POOL, max_num_batched_tokens=budget))
    query_rows.clear()
    got = _sampled_logits(chunked, prompt)
    assert (got[-1] - ref).abs().max().item() < 1e-5
    chunks = -(-90 // budget)
    layers = len(query_rows) // chunks + 1  # the non-sampling chunks' last layers: no call
    assert len(query_rows) == chunks * (layers - 1) + 1 and query_rows[-1] == 1


def test_every_chunk_sampling_keeps_each_rows_logits() -> None:
    """A chunk's sampling row is its last; several sampling chunks each get their own."""
    prompt = _ids(50, 6)
    engine = Engine("tiny", dataclasses.replace(SMALL_POOL, max_num_batched_tokens=16))
    got = _sampled_logits(engine, prompt, samples_each=True)
    _, ref = Engine("tiny", SMALL_POOL).prompt_logits(prompt)
    assert got.shape[0] == 4
    rows = [15, 31, 47, 49]
    assert (got - ref[rows]).abs().max().item() < 1e-5


def test_a_decode_step_reads_every_row_in_order_and_needs_no_gather(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure decode step's logit rows are every row in order (`ForwardInputs.every_row`: the
    model skips the gather); a step with a prompt chunk is not, and a batch decodes the same
    tokens as each sequence alone."""
    from kvcake.engine.sampling import SamplingParams

    seen: list[tuple[int, bool]] = []
    real = model.LlamaModel.forward

    def spy(self: model.LlamaModel, inputs: model.ForwardInputs, *args: object,
            **kwargs: object) -> torch.Tensor:
        seen.append((inputs.input_ids.shape[0], inputs.every_row))
        return real(self, inputs, *args, **kwargs)  # type: ignore[arg-type]

    def decode(prompts: list[list[int]]) -> dict[str, list[int]]:
        engine = Engine("tiny", SMALL_POOL)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    prompts = [_ids(40, 1), _ids(23, 2), _ids(70, 3)]
    monkeypatch.setattr(model.LlamaModel, "forward", spy)
    together = decode(prompts)
    assert (3, True) in seen  # the three decoding together
    assert all(not every for rows, every in seen if rows > 3)  # the prompt steps
    alone = {f"r{i}": decode([p])["r0"] for i, p in enumerate(prompts)}
    assert together == alone

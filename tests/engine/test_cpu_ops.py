"""The paged-attention op equals gather + SDPA, bounds-checks its tables, and the engine falls
back to the gather path when the op cannot be built."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvcake.engine import cpu_ops
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.sampling import SamplingParams

from .conftest import SMALL_POOL

HAVE_CXX = shutil.which(os.environ.get("CXX") or "c++") is not None
needs_op = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler ($CXX or c++) to build the "
                                                   "paged-attention op; the gather path is used")


def _reference(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
               lens: torch.Tensor) -> torch.Tensor:
    """Gather each context out of the pool, then masked SDPA (the engine's fallback path)."""
    _, _, bs, hkv, d = kv.shape
    rows = kv.float().reshape(-1, hkv, d)
    k_rows = (tables[..., None] * 2 * bs + torch.arange(bs)).flatten(1)
    shape = (q.shape[0], -1, hkv, d)
    ks = rows[k_rows.flatten()].view(shape).transpose(1, 2)
    vs = rows[k_rows.flatten() + bs].view(shape).transpose(1, 2)
    mask = (torch.arange(k_rows.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), ks, vs, attn_mask=mask,
                                         scale=d**-0.5, enable_gqa=True)
    return out.squeeze(2)


def _case(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(40, 2, 16, 2, 32, generator=gen).to(dtype)
    lens = torch.tensor([1, 16, 17, 150])  # one token, a full block, one past, many blocks
    tables = torch.stack([torch.randperm(40, generator=gen)[:10] for _ in range(4)])
    q = torch.randn(4, 8, 32, generator=gen).to(dtype)
    return q, kv, tables, lens


@needs_op
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_op_equals_gather_then_sdpa(dtype: torch.dtype, tol: float) -> None:
    assert cpu_ops.load(), cpu_ops.load_error()
    q, kv, tables, lens = _case(dtype)
    out = cpu_ops.paged_decode_attention(q, kv, tables, lens, 32**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - _reference(q, kv, tables, lens)).abs().max().item() < tol


@needs_op
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(8, 2, 64), (8, 1, 128), (4, 4, 32), (6, 2, 24), (6, 2, 64)])
def test_fp32_fast_path_and_generic_loop_equal_gather_then_sdpa(heads: int, kv_heads: int,
                                                                 head_dim: int) -> None:
    """fp32 decode takes the register-resident path for GQA groups of 1/2/4/8 and head_dims of
    2-8 vectors (64 and 128: the served shapes), the generic loop otherwise (group 3, or
    head_dim 24): both equal the reference for contexts of one position, a partial block and
    many scattered blocks."""
    assert cpu_ops.load(), cpu_ops.load_error()
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(60, 2, 16, kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, 9, 16, 33, 700])
    tables = torch.stack([torch.randperm(60, generator=gen)[:44] for _ in range(5)])
    q = torch.randn(5, heads, head_dim, generator=gen)
    out = cpu_ops.paged_decode_attention(q, kv, tables, lens, head_dim**-0.5)
    ref = _reference(q, kv, tables, lens)
    assert (out - ref).abs().max().item() < 1e-5
    for i in range(5):  # one sequence alone = the same row of the batch
        one = cpu_ops.paged_decode_attention(q[i:i + 1], kv, tables[i:i + 1], lens[i:i + 1],
                                             head_dim**-0.5)
        assert torch.equal(one[0], out[i])


@needs_op
def test_op_rejects_tables_that_point_outside_the_pool() -> None:
    assert cpu_ops.load(), cpu_ops.load_error()
    q, kv, tables, lens = _case(torch.float32)
    bad = tables.clone()
    bad[3, 0] = 40
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_decode_attention(q, kv, bad, lens, 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        cpu_ops.paged_decode_attention(q, kv, tables, lens * 0 + 161, 1.0)


@needs_op
def test_engine_decodes_the_same_through_the_op_and_the_gather_path() -> None:
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 40, 17, 90))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for mode in ("kernel", "gather"):
        engine = Engine("tiny", EngineConfig(kv_cache_bytes=4 * 2**20, device="cpu",
                                             attention=mode))
        assert engine.attention == mode
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs[mode] = got
    assert outs["kernel"] == outs["gather"]


def test_a_failed_build_says_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        cpu_ops.build(tmp_path, compiler=str(tmp_path / "no-such-compiler"))
    assert not list(tmp_path.glob("*.so"))


def test_engine_falls_back_to_gather_when_the_op_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    engine = Engine("tiny", SMALL_POOL)
    assert engine.attention == "gather" and not engine.runner.paged_attention
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="could not be built"):
        Engine("tiny", EngineConfig(kv_cache_bytes=4 * 2**20, device="cpu", attention="kernel"))


@needs_op
def test_fused_ops_equal_their_eager_definitions() -> None:
    assert cpu_ops.load(), cpu_ops.load_error()
    ops = torch.ops.kvcake
    gen = torch.Generator().manual_seed(2)
    h, delta, w = (torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen),
                   torch.randn(48, generator=gen))

    def norm(x: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    assert torch.allclose(ops.rms_norm(h, w, 1e-5), norm(h), atol=1e-5)
    total, normed = ops.add_rms_norm(h, delta, w, 1e-5)
    assert torch.allclose(total, h + delta) and torch.allclose(normed, norm(h + delta), atol=1e-5)
    gu = torch.randn(5, 20, generator=gen) * torch.tensor([1.0, 1.0, 1.0, 30.0, 100.0])[:, None]
    assert torch.allclose(ops.silu_mul(gu), F.silu(gu[:, :10]) * gu[:, 10:], rtol=1e-5,
                          atol=1e-6)  # the last rows reach exp's clamped range
    # RoPE + KV store: 4 query heads, 2 KV heads, head dim 8; rows 3 and 6 of a 10-row pool.
    qkv = torch.randn(2, (4 + 2 * 2) * 8, generator=gen)
    ang = torch.randn(2, 4, generator=gen)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), ang.sin()
    pool = torch.zeros(10, 2, 8)
    q, k, v = ops.rope_qkv_store(qkv, cos, sin, pool, torch.tensor([3, 6]), torch.tensor([4, 7]),
                                 4, 2)

    def rope(x: torch.Tensor) -> torch.Tensor:  # x [n, H, 8], the rotate-half definition
        rot = torch.cat((-x[..., 4:], x[..., :4]), -1)
        return x * cos[:, None] + rot * torch.cat((sin, sin), -1)[:, None]

    heads = qkv.view(2, 8, 8)
    assert torch.allclose(q, rope(heads[:, :4]), atol=1e-6)
    assert torch.allclose(k, rope(heads[:, 4:6]), atol=1e-6) and torch.equal(v, heads[:, 6:])
    assert torch.equal(pool[[3, 6]], k) and torch.equal(pool[[4, 7]], v)
    assert pool[[0, 1, 2, 5, 8, 9]].abs().sum() == 0
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_qkv_store(qkv, cos, sin, pool, torch.tensor([3, 10]), torch.tensor([4, 7]), 4, 2)


@needs_op
def test_fused_and_eager_layers_give_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [(5 * j) % 250 + 3 for j in range(70)]
    engine = Engine("tiny", SMALL_POOL)
    _, fused = engine.prompt_logits(prompt)
    monkeypatch.setattr(cpu_ops, "fused", lambda t: False)
    _, eager = Engine("tiny", SMALL_POOL).prompt_logits(prompt)
    assert (fused - eager).abs().max().item() < 1e-5


def _prefill_reference(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                       ctx_len: int) -> torch.Tensor:
    """Gather the context out of the pool, then SDPA with an explicit causal mask."""
    _, _, bs, hkv, d = kv.shape
    rows = kv.reshape(-1, hkv, d)
    pos = torch.arange(ctx_len)
    k_rows = table[pos // bs] * 2 * bs + pos % bs
    ks, vs = rows[k_rows].transpose(0, 1), rows[k_rows + bs].transpose(0, 1)
    n = q.shape[0]
    mask = pos[None, :] <= torch.arange(ctx_len - n, ctx_len)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), ks, vs, attn_mask=mask,
                                         scale=d**-0.5, enable_gqa=True)
    return out.transpose(0, 1)


def _prefill_inputs(heads: int, kv_heads: int, head_size: int, ctx_len: int, q_len: int,
                    ramp: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, a pool with spare blocks, a shuffled block table covering ctx_len. `ramp`: scores
    that rise with the key's position (~0.13 a position in the exp2 domain), so that rows'
    maxima keep moving past the kernel's lazy margin and earlier terms are rescaled."""
    gen = torch.Generator().manual_seed(ctx_len + 7 * q_len + heads)
    blocks = -(-ctx_len // 16)
    kv = torch.randn(blocks + 5, 2, 16, kv_heads, head_size, generator=gen)
    table = torch.randperm(blocks + 5, generator=gen)[:blocks]
    q = torch.randn(q_len, heads, head_size, generator=gen)
    if ramp:
        q[..., 0] = 3.0
        pos = torch.arange(ctx_len)
        kv[table[pos // 16], 0, pos % 16, :, 0] = (pos / 4.0)[:, None]
    return q, kv, table


@needs_op
@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "ctx_len", "q_len", "ramp"), [
    (8, 2, 64, 300, 300, False),   # a whole prompt: several query and KV tiles, partial block
    (8, 2, 64, 150, 37, False),    # a chunk after a cached prefix, starting mid-block
    (4, 2, 32, 45, 1, False),      # one token
    (6, 2, 32, 70, 69, False),     # group 3, odd lengths (row blocks span two positions)
    (4, 4, 128, 33, 17, False),    # no GQA, a wide head
    (8, 1, 32, 129, 64, False),    # group 8 (a position's rows span two row blocks)
    (8, 2, 128, 200, 200, False),  # GQA with a wide head
    (8, 2, 64, 256, 128, False),   # prefix and chunk on KV-tile boundaries
    (8, 2, 64, 331, 1, False),     # one token after a long prefix
    (4, 2, 64, 230, 150, True),    # maxima that keep rising: later tiles rescale earlier ones
])
def test_prefill_op_equals_gather_then_masked_sdpa(heads: int, kv_heads: int, head_size: int,
                                                   ctx_len: int, q_len: int,
                                                   ramp: bool) -> None:
    assert cpu_ops.load(), cpu_ops.load_error()
    if not cpu_ops.paged_prefill_supported(head_size, torch.float32):
        pytest.skip(f"head size {head_size} is not a multiple of this CPU's vector width")
    q, kv, table = _prefill_inputs(heads, kv_heads, head_size, ctx_len, q_len, ramp)
    out = cpu_ops.paged_prefill_attention(q, kv, table, ctx_len, head_size**-0.5)
    assert out.shape == q.shape
    assert (out - _prefill_reference(q, kv, table, ctx_len)).abs().max().item() < 1e-5


@needs_op
def test_prefill_op_split_over_threads_equals_one_thread() -> None:
    # Two threads share the packed K tiles (each packed by whichever thread needs it first).
    assert cpu_ops.load(), cpu_ops.load_error()
    q, kv, table = _prefill_inputs(8, 2, 64, 700, 500)
    threads = torch.get_num_threads()
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            results.append(cpu_ops.paged_prefill_attention(q, kv, table, 700, 0.125))
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(*results)
    assert (results[0] - _prefill_reference(q, kv, table, 700)).abs().max().item() < 1e-5


@needs_op
def test_prefill_op_rejects_bad_tables_and_lengths() -> None:
    assert cpu_ops.load(), cpu_ops.load_error()
    kv = torch.zeros(4, 2, 16, 2, 32)
    q = torch.zeros(3, 4, 32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_prefill_attention(q, kv, torch.tensor([0, 4]), 20, 1.0)
    with pytest.raises(RuntimeError, match="covering the context"):
        cpu_ops.paged_prefill_attention(q, kv, torch.tensor([0]), 20, 1.0)
    with pytest.raises(RuntimeError, match="q_len <= ctx_len"):
        cpu_ops.paged_prefill_attention(q, kv, torch.tensor([0]), 2, 1.0)


@needs_op
def test_engine_prefills_through_the_op_as_through_the_gather_path() -> None:
    # Chunks of 24 over 16-token blocks after a cached 32-token prefix: every path of the op.
    engine = Engine("tiny", EngineConfig(kv_cache_bytes=4 * 2**20, device="cpu",
                                         max_num_batched_tokens=24))
    assert engine.runner.paged_prefill
    prompt = [(11 * j) % 250 + 3 for j in range(90)]
    engine.prompt_logits(prompt[:32])  # caches two full blocks
    cached, paged = engine.prompt_logits(prompt)
    assert cached == 32
    engine.runner.paged_prefill = False
    engine.block_manager = Engine("tiny", SMALL_POOL).block_manager  # nothing cached
    cached, gathered = engine.prompt_logits(prompt)
    assert cached == 0
    assert (paged - gathered[32:]).abs().max().item() < 1e-5


@needs_op
def test_fused_ops_split_over_threads_equal_one_thread() -> None:
    assert cpu_ops.load(), cpu_ops.load_error()
    ops = torch.ops.kvcake
    gen = torch.Generator().manual_seed(4)
    h, delta, w = (torch.randn(300, 48, generator=gen), torch.randn(300, 48, generator=gen),
                   torch.randn(48, generator=gen))
    qkv = torch.randn(300, 8 * 8, generator=gen)
    ang = torch.randn(300, 4, generator=gen)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), ang.sin()
    slots = torch.randperm(600, generator=gen)[:300]
    results = []
    threads = torch.get_num_threads()
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            pool = torch.zeros(1200, 2, 8)
            results.append((ops.rms_norm(h, w, 1e-5), *ops.add_rms_norm(h, delta, w, 1e-5),
                            ops.silu_mul(qkv), *ops.rope_qkv_store(qkv, cos, sin, pool, 2 * slots,
                                                                   2 * slots + 1, 4, 2), pool))
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@needs_op
def test_decode_op_split_over_threads_equals_one_thread_and_the_reference() -> None:
    """A long context (>= 4,096 positions x KV heads) is split over torch's threads: each
    (sequence, KV head) item is computed by the same code whichever thread runs it."""
    assert cpu_ops.load(), cpu_ops.load_error()
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(300, 2, 16, 2, 32, generator=gen)
    lens = torch.tensor([2100, 3, 1500])  # one long (parallel on its own), a batch mixing lengths
    tables = torch.stack([torch.randperm(300, generator=gen)[:140] for _ in range(3)])
    q = torch.randn(3, 8, 32, generator=gen)
    threads = torch.get_num_threads()
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            results.append([cpu_ops.paged_decode_attention(q[i:i + 1], kv, tables[i:i + 1],
                                                           lens[i:i + 1], 32**-0.5)
                            for i in range(3)]
                           + [cpu_ops.paged_decode_attention(q, kv, tables, lens, 32**-0.5)])
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert torch.equal(torch.cat(results[1][:3]), results[1][3])  # batched = one by one
    assert (results[1][3] - _reference(q, kv, tables, lens)).abs().max().item() < 1e-5


@needs_op
def test_argmax_rows_is_torchs_argmax_ties_nans_and_infinities_included() -> None:
    """The first largest value of each row (what torch.argmax returns): a tie goes to the
    earlier index, a NaN counts as the largest (the first NaN), and widths off the op's
    16-lane step are scanned to the end."""
    assert cpu_ops.load(), cpu_ops.load_error()
    argmax_rows = cpu_ops.fused_ops().argmax_rows
    gen = torch.Generator().manual_seed(3)
    for width in (1, 15, 16, 17, 33, 32000):
        x = torch.randn(5, width, generator=gen)
        assert argmax_rows(x) == x.argmax(-1).tolist(), width
    x = torch.zeros(6, 40)
    x[0, [7, 33]] = 2.0  # a tie: the earlier one
    x[1, [3, 20]] = float("nan")  # NaNs: the first NaN, even below a larger value
    x[1, 10] = 9.0
    x[2, 39] = float("nan")  # a NaN in the last lane, after the largest value
    x[2, 1] = 5.0
    x[3] = float("-inf")  # every value -inf: index 0
    x[4, [12, 13]] = float("inf")
    x[5, 38] = 1.0  # in the tail past the last full 16-lane step
    assert argmax_rows(x) == x.argmax(-1).tolist() == [7, 3, 39, 0, 12, 38]


@needs_op
def test_argmax_rows_refuses_what_it_cannot_read_and_greedy_ids_fall_back() -> None:
    from kvcake.engine.sampling import greedy_token_ids

    x = torch.randn(40, 3)
    with pytest.raises(RuntimeError, match="argmax_rows"):
        cpu_ops.fused_ops().argmax_rows(x.t())  # rows not contiguous
    with pytest.raises(RuntimeError, match="argmax_rows"):
        cpu_ops.fused_ops().argmax_rows(x.double())
    # The sampler's greedy ids take torch's argmax wherever the op does not apply.
    assert greedy_token_ids(x.t()) == x.t().argmax(-1).tolist()
    assert greedy_token_ids(x.bfloat16()) == x.bfloat16().argmax(-1).tolist()
    assert greedy_token_ids(x) == x.argmax(-1).tolist()

"""The paged-attention op equals gather + SDPA, bounds-checks its tables, and the engine falls
back to the gather path when the op cannot be built."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvcake.engine import paged_attention
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
    assert paged_attention.load(), paged_attention.load_error()
    q, kv, tables, lens = _case(dtype)
    out = paged_attention.paged_decode_attention(q, kv, tables, lens, 32**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - _reference(q, kv, tables, lens)).abs().max().item() < tol


@needs_op
def test_op_rejects_tables_that_point_outside_the_pool() -> None:
    assert paged_attention.load(), paged_attention.load_error()
    q, kv, tables, lens = _case(torch.float32)
    bad = tables.clone()
    bad[3, 0] = 40
    with pytest.raises(RuntimeError, match="block id out of range"):
        paged_attention.paged_decode_attention(q, kv, bad, lens, 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        paged_attention.paged_decode_attention(q, kv, tables, lens * 0 + 161, 1.0)


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
        paged_attention.build(tmp_path, compiler=str(tmp_path / "no-such-compiler"))
    assert not list(tmp_path.glob("*.so"))


def test_engine_falls_back_to_gather_when_the_op_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention, "load", lambda: False)
    engine = Engine("tiny", SMALL_POOL)
    assert engine.attention == "gather" and not engine.runner.paged_attention
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="could not be built"):
        Engine("tiny", EngineConfig(kv_cache_bytes=4 * 2**20, device="cpu", attention="kernel"))

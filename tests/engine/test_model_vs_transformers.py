"""Our logits and greedy tokens equal transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = [int(x) for x in torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(3))]


def _hf_model(path: Path) -> Any:
    model = transformers.LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    return model.eval()


def test_logits_equal_transformers(hf_dir: Path) -> None:
    hf = _hf_model(hf_dir)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    engine = Engine(str(hf_dir), EngineConfig(kv_cache_bytes=2**22, device="cpu"))
    cached, ours = engine.prompt_logits(PROMPT)
    assert cached == 0
    assert ours.shape == expected.shape == (45, 512)
    assert (ours - expected).abs().max().item() < 1e-4


def test_chunked_paged_logits_equal_transformers(hf_dir: Path) -> None:
    # Chunks of 7 tokens over 16-token blocks: every chunk attends to paged KV mid-block.
    hf = _hf_model(hf_dir)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    engine = Engine(str(hf_dir), EngineConfig(kv_cache_bytes=2**22, device="cpu",
                                              max_num_batched_tokens=7))
    _, ours = engine.prompt_logits(PROMPT)
    assert (ours - expected).abs().max().item() < 1e-4


def test_greedy_tokens_equal_transformers(hf_dir: Path) -> None:
    hf = _hf_model(hf_dir)
    prompts = [PROMPT, PROMPT[:9]]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    llm = LLM(str(hf_dir), EngineConfig(kv_cache_bytes=2**22, device="cpu"))
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_text_prompt_uses_tokenizer_json(hf_dir: Path) -> None:
    llm = LLM(str(hf_dir), EngineConfig(kv_cache_bytes=2**22, device="cpu"))
    [out] = llm.generate("w5 w9 w300", SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.prompt_token_ids == [5, 9, 300]
    assert out.text is not None and len(out.token_ids) == 3

"""Llama-family checkpoints that differ only in config (Mistral, Qwen2 with its q/k/v biases)
load and give transformers' logits; generation_config.json's EOS ids are read.

Each test writes a small random Hugging Face directory with transformers itself (no download).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.loader import resolve

transformers = pytest.importorskip("transformers")

PROMPT = [int(x) for x in torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(5))]
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _write(path: Path, config: Any, model_cls: Any) -> Any:
    torch.manual_seed(11)
    model = model_cls(config).eval()
    with torch.no_grad():  # biases start at zero in transformers: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _max_diff(path: Path, hf: Any) -> float:
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    engine = Engine(str(path), EngineConfig(kv_cache_bytes=2**22, device="cpu",
                                            linear_backend="aten",  # no start-up timing
                                            max_num_batched_tokens=16))  # chunked, paged
    _, ours = engine.prompt_logits(PROMPT)
    assert ours.shape == expected.shape
    return float((ours - expected).abs().max())


def test_qwen2_with_attention_biases_matches_transformers(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(**SHAPE, rms_norm_eps=1e-6, rope_theta=1e6,
                                      tie_word_embeddings=True)
    hf = _write(tmp_path, config, transformers.Qwen2ForCausalLM)
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
    assert hf.model.layers[0].self_attn.o_proj.bias is None
    loaded = resolve(str(tmp_path)).config
    assert (loaded.model_type, loaded.qkv_bias, loaded.attention_bias) == ("qwen2", True, False)
    assert _max_diff(tmp_path, hf) < 1e-4


def test_a_qwen2_bias_that_is_ignored_would_show(tmp_path: Path) -> None:
    """The comparison is sensitive to the biases: dropping them changes the logits."""
    config = transformers.Qwen2Config(**SHAPE)
    hf = _write(tmp_path, config, transformers.Qwen2ForCausalLM)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["model_type"] = "llama"  # loads q/k/v without their biases
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert _max_diff(tmp_path, hf) > 1e-2


def test_mistral_matches_transformers_within_its_window(tmp_path: Path) -> None:
    config = transformers.MistralConfig(**SHAPE, sliding_window=64, rope_theta=1e6)
    hf = _write(tmp_path, config, transformers.MistralForCausalLM)
    loaded = resolve(str(tmp_path)).config
    assert loaded.max_position_embeddings == 64  # contexts never exceed the sliding window
    assert _max_diff(tmp_path, hf) < 1e-4


def test_generation_config_eos_ids_join_the_configs(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**SHAPE, eos_token_id=2)
    _write(tmp_path, config, transformers.LlamaForCausalLM)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert resolve(str(tmp_path)).config.eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id must be an integer"):
        resolve(str(tmp_path))

"""Presets, config parsing, sharded weights and bf16."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvcake.engine.config import PRESETS, EngineConfig, ModelConfig
from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.loader import dummy_weights
from kvcake.engine.sampling import SamplingParams

from .conftest import SMALL_POOL, TINY_LLAMA3


def test_preset_shapes() -> None:
    assert PRESETS["tiny"].hidden_size <= 256 and PRESETS["tiny"].num_layers <= 4
    assert 90e6 <= PRESETS["small"].num_params() <= 130e6
    assert 7.9e9 <= PRESETS["llama3-8b"].num_params() <= 8.1e9
    assert 69e9 <= PRESETS["llama3-70b"].num_params() <= 71.5e9
    assert not PRESETS["llama3-70b"].instantiable


def test_hf_config_round_trip_keeps_llama3_rope_scaling() -> None:
    raw = TINY_LLAMA3.to_hf_dict()
    back = ModelConfig.from_hf_dict(json.loads(json.dumps(raw)), name=TINY_LLAMA3.name)
    assert back.head_dim == back.head_size == TINY_LLAMA3.head_size == 32  # written explicitly
    assert dataclasses.replace(back, head_dim=None) == TINY_LLAMA3
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        ModelConfig.from_hf_dict(raw, name="x")


def test_engine_config_rejects_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['blocksize'\]"):
        EngineConfig.from_dict({"blocksize": 16})
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="unknown keys"):
        LLM("tiny", blocksize=16)


def test_sharded_safetensors_index(tmp_path: Path) -> None:
    state = dummy_weights(TINY_LLAMA3, seed=7)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA3.to_hf_dict()))
    engine = Engine(str(tmp_path), SMALL_POOL)
    assert engine.tokenizer is None  # no tokenizer.json: ids only
    with pytest.raises(ValueError, match="no tokenizer.json"):
        LLM(str(tmp_path), SMALL_POOL).generate("text")
    ref_dir = tmp_path / "single"
    from kvcake.engine.loader import save_hf_dir

    save_hf_dir(TINY_LLAMA3, state, ref_dir)
    _, a = engine.prompt_logits([1, 2, 3, 4])
    _, b = Engine(str(ref_dir), SMALL_POOL).prompt_logits([1, 2, 3, 4])
    assert torch.equal(a, b)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="weight shard .* is missing"):
        Engine(str(tmp_path), SMALL_POOL)


def test_bfloat16_runs_and_stays_close_to_fp32() -> None:
    prompt = list(range(40))
    _, fp32 = Engine("tiny", SMALL_POOL).prompt_logits(prompt)
    bf16 = Engine("tiny", EngineConfig(kv_cache_bytes=2**21, dtype="bfloat16", device="cpu"))
    assert bf16.namespace != Engine("tiny", SMALL_POOL).namespace  # KV layouts never mix
    _, low = bf16.prompt_logits(prompt)
    assert low.dtype == torch.float32 and (low - fp32).abs().max().item() < 0.1
    out = LLM("tiny", dtype="bfloat16", kv_cache_bytes=2**21, device="cpu").generate(
        [prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4

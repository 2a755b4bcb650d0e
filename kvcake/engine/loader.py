"""Where a model comes from: a preset with seeded dummy weights, or a Hugging Face directory.

`resolve(model)` turns the user's `--model` string into a `ModelSource` (shape, where the
weights are, the tokenizer) or raises ValueError naming `model` and what to change.
`load_weights(source, seed)` returns weights in Hugging Face naming; `save_hf_dir` writes a
directory that transformers' `LlamaForCausalLM.from_pretrained` loads (tests and benchmarks
compare against it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from kvcake.engine.config import PRESETS, ModelConfig
from kvcake.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    directory: Path | None  # None: a preset (dummy weights)
    tokenizer: Tokenizer | None  # None: the directory has no tokenizer.json (token ids only)


def resolve(model: str) -> ModelSource:
    path = Path(model)
    if model in PRESETS:
        config = PRESETS[model]
        if not config.instantiable:
            raise ValueError(f"model: preset {model!r} is a shape for cost models only and is "
                             f"never instantiated; use 'tiny' or 'small', or a model directory")
        return ModelSource(config, None, ByteTokenizer())
    if not path.is_dir():
        raise ValueError(f"model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         f"directory; pass a preset name or a Hugging Face model directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model: directory {model!r} has no config.json; pass a Hugging Face "
                         "model directory (config.json, *.safetensors, tokenizer.json)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"model: {config_path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model: {config_path} must hold a JSON object")
    config = _with_generation_eos(ModelConfig.from_hf_dict(raw, name=path.name), path)
    if not _weight_files(path):
        raise ValueError(f"model: directory {model!r} has no *.safetensors weights")
    tok_path = path / "tokenizer.json"
    tokenizer = HFTokenizer(tok_path) if tok_path.is_file() else None
    return ModelSource(config, path, tokenizer)


def _with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """generation_config.json's `eos_token_id` (one or a list) joins config.json's EOS ids."""
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return config
    try:
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"model: {gen_path} is not a JSON object ({exc})") from None
    extra = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(e, int) for e in extra):
        raise ValueError(f"model: {gen_path}: eos_token_id must be an integer or a list of "
                         f"integers, got {eos!r}")
    ids = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
    return replace(config, eos_token_ids=ids)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"model: {index} is malformed ({exc!r})") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def load_weights(source: ModelSource, seed: int) -> dict[str, Tensor]:
    if source.directory is None:
        return dummy_weights(source.config, seed)
    state: dict[str, Tensor] = {}
    for file in _weight_files(source.directory):
        if not file.is_file():
            raise ValueError(f"model: weight shard {file} named in the index is missing")
        try:
            state.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own error type on a corrupt file
            raise ValueError(f"model: cannot read weights {file} ({exc})") from None
    return state


def dummy_weights(config: ModelConfig, seed: int) -> dict[str, Tensor]:
    """Seeded random weights in Hugging Face naming (normal, std 0.02; norms near 1)."""
    gen = torch.Generator().manual_seed(seed)
    d, hd, inter = config.hidden_size, config.head_size, config.intermediate_size

    def normal(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    def norm() -> Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=gen)

    state = {"model.embed_tokens.weight": normal(config.vocab_size, d), "model.norm.weight": norm()}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, d)
    shapes = {"self_attn.q_proj": (config.num_heads * hd, d),
              "self_attn.k_proj": (config.num_kv_heads * hd, d),
              "self_attn.v_proj": (config.num_kv_heads * hd, d),
              "self_attn.o_proj": (d, config.num_heads * hd),
              "mlp.gate_proj": (inter, d), "mlp.up_proj": (inter, d), "mlp.down_proj": (d, inter)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            state[p + name + ".weight"] = normal(*shape)
            is_attn = name.startswith("self_attn")
            attn_bias = config.attention_bias or (config.qkv_bias and name != "self_attn.o_proj")
            if (attn_bias and is_attn) or (config.mlp_bias and not is_attn):
                state[p + name + ".bias"] = normal(shape[0])
        state[p + "input_layernorm.weight"] = norm()
        state[p + "post_attention_layernorm.weight"] = norm()
    return state


def save_hf_dir(config: ModelConfig, state: dict[str, Tensor], path: Path) -> None:
    """Write config.json and model.safetensors that transformers loads as LlamaForCausalLM."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))

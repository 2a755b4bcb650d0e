"""Engine fixtures: small engines on the `tiny` preset and a tiny Hugging Face directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvcake.engine.config import PRESETS, EngineConfig, ModelConfig, RopeScaling
from kvcake.engine.engine import Engine
from kvcake.engine.loader import dummy_weights, save_hf_dir

torch.set_num_threads(1)  # a shared 2-core machine: no OMP barrier waits

SMALL_POOL = EngineConfig(kv_cache_bytes=4 * 2**20, device="cpu")

# The tiny shape with Llama-3 rope scaling and tied embeddings, so the HF comparison covers them.
TINY_LLAMA3 = dataclasses.replace(
    PRESETS["tiny"], name="tiny-llama3", tie_word_embeddings=True, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64))


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer.json: 'w<i>' is id i."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def make_hf_dir(path: Path, config: ModelConfig, seed: int = 7) -> Path:
    save_hf_dir(config, dummy_weights(config, seed), path)
    write_word_tokenizer(path, config.vocab_size)
    return path


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("tiny-llama3"), TINY_LLAMA3)


@pytest.fixture
def engine() -> Engine:
    return Engine("tiny", SMALL_POOL)


def config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture
def kvcake_main(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`kvcake.cli.main`; for `generate` it imports only the engine's command module."""
    import kvcake.cli

    return kvcake.cli.main

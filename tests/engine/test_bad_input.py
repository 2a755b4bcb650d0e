"""Bad input: a ValueError naming the field (CLI: exit 2, one line); the engine keeps serving."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.llm import LLM
from kvcake.engine.sampling import SamplingParams

from .conftest import SMALL_POOL, config_json, make_hf_dir
from .conftest import TINY_LLAMA3 as TINY_HF

OK = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", SMALL_POOL)


@pytest.mark.parametrize(("prompts", "params", "match"), [
    ([[]], OK, "prompt: the prompt is empty"),
    ([], OK, "prompt: the prompt is empty"),
    ([[1, 2, 512]], OK, r"prompt_token_ids: token id 512 at index 2 .*\[0, 512\)"),
    ([[1, -1]], OK, "prompt_token_ids: token id -1"),
    ([[1, 2], [3, 9999]], OK, "prompt_token_ids: token id 9999"),
    ([[1] * 2000], SamplingParams(max_tokens=49), "max_tokens: .* exceeds max_model_len 2048"),
])
def test_bad_request_raises_and_engine_keeps_serving(llm: LLM, prompts: list, params: SamplingParams,
                                                     match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()  # nothing half-queued
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    [out] = llm.generate([[1, 2, 3]], OK)
    assert len(out.token_ids) == 4


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"stop_token_ids": (-3,)}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_too_big_for_the_pool_is_rejected() -> None:
    engine = Engine("tiny", EngineConfig(num_blocks=2, device="cpu"))
    with pytest.raises(ValueError, match="max_tokens: .* more KV blocks"):
        engine.add_request("r", [1] * 30, SamplingParams(max_tokens=8))
    engine.add_request("r", [1] * 20, SamplingParams(max_tokens=8))  # 28 tokens fit in 2 blocks
    with pytest.raises(ValueError, match="request_id: 'r' is already in use"):
        engine.add_request("r", [1], OK)


@pytest.mark.parametrize(("model", "match"), [
    ("nope", "model: 'nope' is neither a preset"),
    ("llama3-70b", "model: preset 'llama3-70b' is a shape for cost models only"),
])
def test_unknown_or_shape_only_preset(model: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(model)


def _broken_dirs(root: Path) -> dict[str, tuple[Path, str]]:
    good = make_hf_dir(root / "good", TINY_HF)
    cases: dict[str, tuple[Path, str]] = {}
    empty = root / "empty"
    empty.mkdir()
    cases["no config"] = (empty, "has no config.json")
    bad_json = make_hf_dir(root / "badjson", TINY_HF)
    (bad_json / "config.json").write_text("{not json")
    cases["bad json"] = (bad_json, "is not valid JSON")
    gpt = make_hf_dir(root / "gpt", TINY_HF)
    raw = config_json(gpt)
    raw["model_type"] = "gpt2"
    (gpt / "config.json").write_text(json.dumps(raw))
    cases["model type"] = (gpt, "model_type 'gpt2' is not supported")
    missing = make_hf_dir(root / "missing", TINY_HF)
    raw = config_json(missing)
    del raw["hidden_size"]
    (missing / "config.json").write_text(json.dumps(raw))
    cases["missing field"] = (missing, "missing required field 'hidden_size'")
    noweights = make_hf_dir(root / "noweights", TINY_HF)
    (noweights / "model.safetensors").unlink()
    cases["no weights"] = (noweights, r"has no \*.safetensors")
    corrupt = make_hf_dir(root / "corrupt", TINY_HF)
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    cases["corrupt weights"] = (corrupt, "cannot read weights")
    shape = make_hf_dir(root / "shape", TINY_HF)
    raw = config_json(shape)
    raw["intermediate_size"] = 100
    (shape / "config.json").write_text(json.dumps(raw))
    cases["shape mismatch"] = (shape, "weights do not match config.json")
    cases["good"] = (good, "")
    return cases


def test_missing_or_malformed_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture, kvcake_main) -> None:
    for name, (path, match) in _broken_dirs(tmp_path).items():
        if name == "good":
            assert LLM(str(path), EngineConfig(num_blocks=8, device="cpu")).engine.num_blocks == 8
            continue
        with pytest.raises(ValueError, match=f"model: .*{match}|config.json: .*{match}"):
            LLM(str(path), EngineConfig(num_blocks=8, device="cpu"))
        assert kvcake_main(["generate", "--model", str(path), "--prompt-ids", "1,2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvcake generate: error:"), (name, err)


@pytest.mark.parametrize(("argv", "match"), [
    (["--prompt-ids", "1,x"], "--prompt-ids: 'x' is not an integer"),
    (["--prompt-ids", ""], "prompt: the prompt is empty"),
    (["--prompt-ids", "1,600"], "prompt_token_ids: token id 600"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--prompt-ids", "1", "--max-tokens", "5000"], "max_tokens: .* exceeds max_model_len"),
    (["--prompt-ids", "1", "--model", "unknown"], "model: 'unknown' is neither"),
])
def test_cli_bad_input_exits_2_with_one_line(argv: list[str], match: str,
                                             capsys: pytest.CaptureFixture, kvcake_main) -> None:
    assert kvcake_main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.search(match, err), err

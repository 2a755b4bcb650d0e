"""Chunked pipeline parallelism in the engine: layer-slice stages (`StageEngine`) fed chunk by
chunk give the single engine's tokens, and their KV, written layer by layer into a decode
engine's reserved blocks, lets it decode the same greedy continuation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcake.engine.config import PRESETS
from kvcake.engine.engine import Engine
from kvcake.engine.model import LlamaModel
from kvcake.engine.sampling import SamplingParams
from kvcake.engine.stage import StageEngine, split_layers

from .conftest import SMALL_POOL

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = [int(x) for x in torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(4))]


def _single(prompt: list[int]) -> list[int]:
    engine = Engine("tiny", SMALL_POOL)
    engine.add_request("r", prompt, GREEDY)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def _pipeline(stages: list[StageEngine], prompt: list[int], chunk: int) -> int:
    for s in stages:
        assert s.begin("r", prompt, GREEDY)
    token = None
    for start in range(0, len(prompt), chunk):
        n = min(chunk, len(prompt) - start)
        hidden = None
        for s in stages:
            hidden = s.run_chunk("r", start, n, hidden)
        if start + n == len(prompt):
            token = hidden
    assert isinstance(token, int)
    return token


def test_split_layers() -> None:
    assert split_layers(12, 2) == [range(0, 6), range(6, 12)]
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError, match="1..4"):
        split_layers(4, 5)


def test_slice_holds_only_its_layers() -> None:
    cfg = PRESETS["tiny"]
    mid = LlamaModel(cfg, range(1, 3))
    assert len(mid.layers) == 2 and not hasattr(mid, "embed_tokens") and not hasattr(mid, "lm_head")
    with pytest.raises(ValueError, match="contiguous"):
        LlamaModel(cfg, range(2, 9))
    stage = StageEngine("tiny", range(1, 3), SMALL_POOL)
    assert stage.pool.num_layers == 2
    assert stage.begin("r", PROMPT[:20])
    with pytest.raises(ValueError, match="previous stage's hidden"):
        stage.run_chunk("r", 0, 20)
    with pytest.raises(ValueError, match="not in this stage"):
        stage.layer_view(0, 0)


@pytest.mark.parametrize("num_stages,chunk", [(2, 40), (3, 64), (4, 150)])
def test_stages_give_the_single_engines_tokens(num_stages: int, chunk: int) -> None:
    expected = _single(PROMPT)
    stages = [StageEngine("tiny", r, SMALL_POOL) for r in split_layers(4, num_stages)]
    first = _pipeline(stages, PROMPT, chunk)
    assert first == expected[0] and len(set(expected)) > 2  # a prompt whose tokens vary
    # Each stage's layers go straight into a decode engine's reserved blocks.
    decode = Engine("tiny", SMALL_POOL)
    targets = decode.reserve_request("r", PROMPT, GREEDY)
    assert targets is not None
    base = decode.pool.kv.view(torch.uint8).numpy().reshape(-1)
    for s in stages:
        for src, dst in zip(s.block_ids("r"), targets, strict=True):
            for layer in s.layers:
                off = decode.pool.layer_offset_bytes(dst, layer)
                view = s.layer_view(src, layer)
                base[off:off + len(view)] = view
        s.release("r")
    decode.commit_reserved("r", first)
    out = [first]
    while decode.has_unfinished():
        for o in decode.step():
            out.extend(o.new_token_ids)
    assert out == expected


def test_stages_of_a_tied_llama3_model(hf_dir: Path) -> None:
    """Tied embeddings (the last stage holds the embedding for lm_head) and Llama-3 RoPE
    scaling, loaded from a Hugging Face directory."""
    prompt = PROMPT[:100]
    engine = Engine(str(hf_dir), SMALL_POOL)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    expected = [t for o in engine.step() for t in o.new_token_ids]
    stages = [StageEngine(str(hf_dir), r, SMALL_POOL) for r in split_layers(4, 2)]
    assert hasattr(stages[1].model, "embed_tokens") and not hasattr(stages[0].model, "lm_head")
    assert [_pipeline(stages, prompt, 32)] == expected

"""The C++ decode loop (`decode_layers`) makes the Python loop's calls: a decode step's logits
and KV are bit-identical to the layer-by-layer path's on every linear backend, and only pure
decode steps without a layer hook take it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcake.engine import cpu_ops
from kvcake.engine.engine import Engine
from kvcake.engine.linear import BACKENDS
from kvcake.engine.sampling import SamplingParams

from .conftest import SMALL_POOL

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="kvcake's CPU ops did not build "
                                "(the C++ decode loop is one of them)")

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((19, 33, 8))]


def _recorded(engine: Engine) -> list[torch.Tensor]:
    """Every forward's logits, as the runner receives them."""
    logits: list[torch.Tensor] = []
    forward = engine.model.forward

    def record(*args: Any) -> torch.Tensor:
        out = forward(*args)
        logits.append(out.clone())
        return out

    engine.model.forward = record  # type: ignore[method-assign]
    return logits


def _run(engine: Engine, prompts: list[list[int]],
         hook: Callable[[int], None] | None) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                           ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step(layer_hook=hook):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [1, 3])  # the one-row bucket (GEMV backends) and a few rows
def test_the_cpp_loop_equals_the_python_loop(backend: str, batch: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    config = dataclasses.replace(SMALL_POOL, linear_backend=backend)
    cpp, python = Engine("tiny", config), Engine("tiny", config)
    ops = cpu_ops.fused_ops()
    calls: list[int] = []
    real = ops.decode_layers

    def counted(h: torch.Tensor, *args: Any) -> Any:
        calls.append(h.shape[0])
        return real(h, *args)

    monkeypatch.setattr(ops, "decode_layers", counted)
    got, want = _recorded(cpp), _recorded(python)
    tokens = _run(cpp, PROMPTS[:batch], None)
    python_calls = len(calls)
    assert _run(python, PROMPTS[:batch], lambda layer: None) == tokens
    assert len(calls) == python_calls  # a step with a layer hook stays in Python
    assert calls and set(calls) == {batch}  # every decode step, all rows, none of the prompts'
    assert len(got) == len(want) == len(calls) + 1  # one prompt step, then decode steps
    for ours, theirs in zip(got, want, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(cpp.runner.pool.kv, python.runner.pool.kv)


def test_bad_operands_are_refused_with_what_is_wrong() -> None:
    ops = cpu_ops.fused_ops()
    h = torch.zeros(1, 64)
    kv = torch.zeros(2, 2, 16, 1, 16)
    rows = kv.view(-1, 1, 16)
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="four products per layer"):
        ops.decode_layers(h, None, torch.zeros(1, 16), torch.zeros(1, 8), [kv], [rows], empty,
                          empty, empty.view(1, 0), empty, [h[0], h[0]], [1e-6, 1e-6], [0],
                          [torch.zeros(64, 64)], [None], [None], [0], [], [], 0.25, 4, 1)
    with pytest.raises(RuntimeError, match="no packed weight"):
        ops.decode_layers(h, None, torch.zeros(1, 16), torch.zeros(1, 8), [kv], [rows], empty,
                          empty, empty.view(1, 0), empty, [h[0], h[0]], [1e-6, 1e-6],
                          [2, 0, 0, 0], [torch.zeros(64, 64)] * 4, [None] * 4, [None] * 4,
                          [0] * 4, [], [], 0.25, 4, 1)

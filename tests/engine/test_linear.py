"""Linear layers: every GEMM backend keeps the logits within 1e-4 of transformers; the
start-up choice only ever picks an eligible backend, and keeps the reference on a tie
(torch's default for a few rows, oneDNN's prepacked GEMM for a prefill chunk)."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvcake.engine import linear
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.linear import (
    BACKENDS,
    BUCKETS,
    COLD_ROWS,
    GEMM_MIN_ROUNDS,
    MIN_ROUNDS,
    ONE_ROW,
    Kernel,
    Linear,
    bucket_of,
    table_path,
    tune,
)
from kvcake.engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = [int(x) for x in torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(5))]


@pytest.fixture(scope="module")
def hf_logits(hf_dir: Path) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        return hf.eval()(torch.tensor([PROMPT])).logits[0].float()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 7, 100])  # one row (GEMV), a few, many: every bucket
def test_every_backend_matches_transformers(hf_dir: Path, hf_logits: torch.Tensor, backend: str,
                                            chunk: int) -> None:
    engine = Engine(str(hf_dir), EngineConfig(kv_cache_bytes=2**22, device="cpu",
                                              max_num_batched_tokens=chunk,
                                              linear_backend=backend))
    wanted = backend if backend not in ONE_ROW or chunk == 1 else "aten"
    assert engine.model.lm_head.kernel is not None
    assert engine.model.lm_head.kernel.choice[bucket_of(chunk)] == wanted
    _, ours = engine.prompt_logits(PROMPT)
    assert (ours - hf_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_equals_f_linear_with_bias(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    kernel = Kernel(w, b)
    kernel.prepare(backend)
    for rows in (1, 3, 70):
        if backend in ONE_ROW and rows != 1:
            continue
        x = torch.randn(rows, 40, generator=gen)
        assert torch.allclose(kernel.run(x, backend), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_give_an_empty_result_on_every_backend(backend: str) -> None:
    layer = Linear(16, 24)
    tune([layer], backend)
    assert layer(torch.empty(0, 16)).shape == (0, 24)


def test_a_prompt_longer_than_the_token_budget_runs_with_the_one_row_backend() -> None:
    # Its first chunk samples nothing: the lm_head gets 0 rows (regression: an assertion).
    engine = Engine("tiny", EngineConfig(kv_cache_bytes=2**22, device="cpu",
                                         max_num_batched_tokens=32, linear_backend="mkl_gemv"))
    engine.add_request("long", list(range(3, 103)), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _layers() -> list[Linear]:
    torch.manual_seed(0)
    return [Linear(64, 96), Linear(64, 96, bias=False), Linear(96, 64)]


def test_auto_keeps_the_reference_when_nothing_is_clearly_faster() -> None:
    ticks = itertools.count()
    layers = _layers()
    choices = tune(layers, "auto", clock=lambda: float(next(ticks)))  # every call takes 1 tick
    assert {c.shape for c in choices} == {(96, 64), (64, 96)}  # one measurement per shape
    # torch's default where the weights' reads bound a call, oneDNN's prepacked GEMM where
    # the arithmetic does (prefill chunks)
    gemm = "onednn" if torch.backends.mkldnn.is_available() else "aten"
    expected = ["aten" if rows <= COLD_ROWS else gemm for _, rows in BUCKETS]
    assert expected[0] == "aten" and expected[-1] == gemm
    for layer in layers:
        assert layer.kernel is not None and layer.kernel.choice == expected


def test_compute_bound_buckets_get_more_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[int] = Counter()
    run = Kernel.run

    def counted(self: Kernel, x: torch.Tensor, backend: str) -> torch.Tensor:
        calls[x.shape[0]] += 1
        return run(self, x, backend)

    monkeypatch.setattr(Kernel, "run", counted)
    clock = itertools.count()
    tune([Linear(64, 96)], "auto", clock=lambda: next(clock) * 0.002)  # 2 ms between reads
    # rows 4, 256 and 1024 have the same candidates; one warm-up call each, then the rounds
    assert calls[4] % (MIN_ROUNDS + 1) == 0 and calls[256] == calls[1024]
    assert calls[256] // (GEMM_MIN_ROUNDS + 1) == calls[4] // (MIN_ROUNDS + 1)


def test_auto_choices_are_eligible_and_packed_forms_unused_are_dropped() -> None:
    layers = _layers()
    for choice in tune(layers, "auto"):
        assert all(b in BACKENDS for b in choice.backends)
        assert all(b not in ONE_ROW for b in choice.backends[1:])  # one-row packing only
    x = torch.randn(5, 64)
    for layer in layers[:2]:
        kernel = layer.kernel
        assert kernel is not None
        assert (kernel._onednn is None) == ("onednn" not in kernel.choice)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_choices_are_kept_in_a_table_and_not_measured_again(tmp_path: Path) -> None:
    table = table_path(tmp_path, 2)
    ticks = itertools.count()
    first = tune(_layers(), "auto", clock=lambda: float(next(ticks)), table=table)
    assert table.is_file() and len(first) == 2

    def no_clock() -> float:
        raise AssertionError("measured although the table has every shape")

    layers = _layers()
    again = tune(layers, "auto", clock=no_clock, table=table)
    assert [c.backends for c in again] == [c.backends for c in first]
    assert layers[0].kernel is not None
    table.write_text("{not json")  # a damaged table is measured again and rewritten
    tune(_layers(), "auto", clock=lambda: float(next(ticks)), table=table)
    assert table.read_text().startswith("{\n")


def test_forced_backend_applies_where_it_can_and_non_fp32_is_left_alone() -> None:
    layers = _layers()
    tune(layers, "mkl_gemv")
    assert layers[0].kernel is not None
    assert layers[0].kernel.choice == ["mkl_gemv"] + ["aten"] * (len(BUCKETS) - 1)
    half = Linear(8, 8).to(torch.bfloat16)
    tune([half], "onednn")
    assert half.kernel is None


def test_bad_backend_names_say_what_to_choose() -> None:
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        EngineConfig(linear_backend="mkl")
    with pytest.raises(ValueError, match="choose from"):
        tune(_layers(), "fast")


def test_a_new_tuning_version_measures_again(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Tables measured the old way (e.g. on a busy machine, with fewer rounds) are not reused.
    before = table_path(tmp_path, 2)
    monkeypatch.setattr(linear, "TUNING_VERSION", linear.TUNING_VERSION + 1)
    assert table_path(tmp_path, 2) != before
    assert table_path(tmp_path, 2).parent == before.parent


def _split_ops() -> None:
    from kvcake.engine import cpu_ops
    if not cpu_ops.load():
        pytest.skip(f"kvcake's CPU ops did not build: {cpu_ops.load_error()}")
    if not linear._available("mkl_split"):
        pytest.skip("this torch has no MKL packed GEMV")


def test_the_split_one_row_product_covers_every_part_whatever_the_thread_count() -> None:
    _split_ops()
    # 7 rows over 1-3 threads: parts of unequal size (chunk), each written to its own slice.
    gen = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(7, 32, generator=gen), torch.randn(7, generator=gen), \
        torch.randn(1, 32, generator=gen)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for bias in (b, None):
                kernel = Kernel(w, bias)
                kernel.prepare("mkl_split")
                assert kernel._split is not None and len(kernel._split[0]) == min(n, 7)
                assert torch.allclose(kernel.run(x, "mkl_split"), F.linear(x, w, bias),
                                      atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


class _Timed:
    """A clock that advances by an injected cost per (backend, rows) at each measured call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cost: dict[str, float]) -> None:
        self.now = 0.0
        run = Kernel.run

        def timed(kernel: Kernel, x: torch.Tensor, backend: str) -> torch.Tensor:
            self.now += cost.get(backend, 1.0) if x.shape[0] == 1 else 1.0
            return run(kernel, x, backend)

        monkeypatch.setattr(Kernel, "run", timed)

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("split_ticks", "wanted"), [(12, "mkl_split"), (25, "mkl_gemv"),
                                                     (20, "mkl_gemv")])
def test_the_one_row_bucket_takes_the_split_product_only_where_it_measured_faster(
        monkeypatch: pytest.MonkeyPatch, split_ticks: int, wanted: str) -> None:
    _split_ops()
    # Whole ticks (exact differences): aten 30, MKL's one-thread GEMV 20; the split wins only
    # where it is faster (a tie keeps the one-thread GEMV, listed first), so a machine where it
    # loses keeps the faster one.
    cost = {"aten": 30.0, "aten_t": 30.0, "onednn": 30.0, "mkl_gemv": 20.0,
            "mkl_split": float(split_ticks)}
    layer = Linear(64, 96)
    (choice,) = tune([layer], "auto", clock=_Timed(monkeypatch, cost))
    assert choice.backends[0] == wanted
    assert all(b not in ONE_ROW for b in choice.backends[1:])
    assert choice.ms[0]["mkl_split"] == 1e3 * split_ticks
    kernel = layer.kernel
    assert kernel is not None and (kernel._split is None) == (wanted != "mkl_split")
    x = torch.randn(1, 64)
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)

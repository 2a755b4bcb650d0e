"""`kvcake profile`: this machine's prefill and decode times on the engine, fitted and cached.

The Conductor predicts T_prefill = f(input_len, prefix_len) with a polynomial regression and the
decode step time (TBT) with a linear one (kvcake.conductor.predictor). Here both are fitted on
times measured on the live engine: a grid of (input length, cached prefix length) prefills and a
few decode steps of (batch size, context). The default grid spans the prompts the engine takes
(`ProfileGrid.spanning`), so the Conductor's TTFT estimate of a long prompt is read off measured
points, not extrapolated from short ones. The fit is cached as JSON under the cache directory,
keyed by model, dtype and torch threads, and `serve` reuses it (profiling on first use; a cache
of an older format is measured again).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcake.conductor import (
    DecodePoint,
    DecodeStepPredictor,
    PrefillPoint,
    PrefillTimePredictor,
)
from kvcake.engine import cpu_ops
from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.engine.sampling import SamplingParams
from kvcake.ids import CountingIds

PROFILE_FORMAT = 2  # 2: default grid over the engine's prompts (1: prompts of <= 384 tokens)
LONGEST_PROFILED_PROMPT = 8192  # tokens; ~2 s of prefill for the 44M benchmark model, 1 thread
LONGEST_PROFILED_CONTEXT = 2048  # tokens per sequence of a profiled decode step
# A spanning grid stops doubling after a cold prefill this long (a larger model measures shorter
# prompts): 1 thread, the `small` preset profiles in ~38 s (to 3,072 tokens), the 44M capacity
# benchmark model in ~25 s (to 8,192).
LONGEST_PROFILED_PREFILL_S = 2.0


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure. The bare default is small (a few seconds on the tiny preset); what `serve`
    and `kvcake profile` measure by default is `spanning` the engine's prompts."""

    input_lens: tuple[int, ...] = (32, 96, 192, 384)
    prefix_fracs: tuple[float, ...] = (0.0, 0.5, 0.9)
    decode_batch_sizes: tuple[int, ...] = (1, 4, 8)
    decode_context_lens: tuple[int, ...] = (32, 256)
    repeats: int = 2  # the minimum of this many runs is kept (noise on a shared machine)
    # None: every length. Else no longer length after a cold prefill slower than this (at
    # least 3 lengths are measured), and no decode point whose batch holds more prompt tokens
    # than the longest prompt measured.
    longest_prefill_s: float | None = None

    def __post_init__(self) -> None:
        if len(self.input_lens) < 3 or min(self.input_lens) < 2:
            raise ValueError("input_lens: give at least 3 lengths, each >= 2")
        if len(self.prefix_fracs) < 2 or not all(0 <= f < 1 for f in self.prefix_fracs):
            raise ValueError("prefix_fracs: give at least 2 shares in [0, 1)")
        if not self.decode_batch_sizes or not self.decode_context_lens or \
                min(self.decode_batch_sizes) < 1 or min(self.decode_context_lens) < 1:
            raise ValueError("decode_batch_sizes, decode_context_lens: positive values needed")
        if self.repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {self.repeats}")
        if self.longest_prefill_s is not None and not self.longest_prefill_s > 0:
            raise ValueError(f"longest_prefill_s: must be > 0 seconds or None, got "
                             f"{self.longest_prefill_s}")

    @classmethod
    def spanning(cls, max_prompt_tokens: int, kv_pool_tokens: int) -> ProfileGrid:
        """The default grid stretched over an engine's prompts: the short lengths, then doubling
        up to the longest prompt it takes (`max_prompt_tokens`, within its KV pool), at most
        LONGEST_PROFILED_PROMPT; decode steps also at the longest context per sequence the pool
        holds for the largest batch twice over, at most half the prompt limit (its requests
        generate while the batch prefills) and LONGEST_PROFILED_CONTEXT; on a model whose cold
        prefill passes LONGEST_PROFILED_PREFILL_S sooner, both stop there. On prompts of
        <= 384 tokens only, a quadratic fit put the benchmark model's 3,024-token prompt 18% and
        its 20,826-token one 30% above a fit over 256..8,192 tokens (issue 11)."""
        base = cls()
        longest = max(2, min(max_prompt_tokens, kv_pool_tokens - 1, LONGEST_PROFILED_PROMPT))
        lens = [n for n in base.input_lens if n < longest]
        while lens and 2 * lens[-1] < longest:
            lens.append(2 * lens[-1])
        lens.append(longest)
        if len(lens) < 3:
            lens = sorted({max(2, longest // 4), max(2, longest // 2), longest})
        # half the context: a decode point's requests also generate through their batch's prefill
        context = min(LONGEST_PROFILED_CONTEXT, max_prompt_tokens // 2,
                      kv_pool_tokens // (2 * max(base.decode_batch_sizes)))
        contexts = [c for c in base.decode_context_lens if c < context] + [max(1, context)]
        return cls(input_lens=tuple(sorted(set(lens))),
                   decode_context_lens=tuple(sorted(set(contexts))),
                   longest_prefill_s=LONGEST_PROFILED_PREFILL_S)


@dataclass(frozen=True)
class Profile:
    model: str
    dtype: str
    num_threads: int
    prefill: PrefillTimePredictor
    decode: DecodeStepPredictor
    prefill_points: list[PrefillPoint] = field(default_factory=list)
    decode_points: list[DecodePoint] = field(default_factory=list)

    format: int = PROFILE_FORMAT

    def to_json(self) -> str:
        return json.dumps({
            "format": self.format, "model": self.model, "dtype": self.dtype,
            "num_threads": self.num_threads,
            "prefill": json.loads(self.prefill.to_json()),
            "decode": json.loads(self.decode.to_json()),
            "prefill_points": [[p.input_len, p.prefix_len, p.time_s] for p in self.prefill_points],
            "decode_points": [[p.batch_size, p.context_tokens, p.time_s]
                              for p in self.decode_points]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        return cls(data["model"], data["dtype"], int(data["num_threads"]),
                   PrefillTimePredictor.from_json(json.dumps(data["prefill"])),
                   DecodeStepPredictor.from_json(json.dumps(data["decode"])),
                   [PrefillPoint(int(a), int(b), float(c)) for a, b, c in data["prefill_points"]],
                   [DecodePoint(int(a), int(b), float(c)) for a, b, c in data["decode_points"]],
                   int(data.get("format", 1)))


DEFAULT_STEP_TOKENS = EngineConfig.max_num_batched_tokens  # the budget profiled without a suffix


def default_cache_dir() -> Path:
    """`profiles/` under kvcake's per-machine cache (`$KVCAKE_CACHE_DIR`, as the CPU ops and the
    GEMM tuning tables use it; default `~/.cache/kvcake`)."""
    return cpu_ops.cache_dir() / "profiles"


def cache_path(cache_dir: Path, model: str, dtype: str, num_threads: int,
               max_num_batched_tokens: int = DEFAULT_STEP_TOKENS) -> Path:
    """The profile of (model, dtype, torch threads, the engine's token budget per step): a
    budget other than the default prefills a prompt in more, smaller chunks, which takes
    longer (a colocated worker at 64 tokens), so it is measured and cached apart
    (`-b<budget>`); the default budget's file keeps its name."""
    safe = model.replace("/", "_").strip("._") or "model"
    budget = "" if max_num_batched_tokens == DEFAULT_STEP_TOKENS else f"-b{max_num_batched_tokens}"
    return cache_dir / f"profile-{safe}-{dtype}-t{num_threads}{budget}.json"


def measure_prefill(engine: Engine, grid: ProfileGrid, seed: int = 0) -> list[PrefillPoint]:
    """Seconds of one prefill step per (input_len, cached prefix_len) of the grid (its longer
    lengths left out past `grid.longest_prefill_s`)."""
    rng = np.random.default_rng(seed)
    ids = CountingIds("profile-prefill")
    vocab = min(engine.model_config.vocab_size, 256)
    _prefill_s(engine, ids, rng.integers(0, vocab, 16).tolist())  # warm-up
    points = []
    for i, n in enumerate(grid.input_lens):
        for frac in grid.prefix_fracs:
            best, cached = float("inf"), 0
            for _ in range(grid.repeats):
                prompt = rng.integers(0, vocab, n).tolist()  # fresh: nothing else is cached
                prefix = int(n * frac)
                if prefix >= engine.block_size:
                    _prefill_s(engine, ids, prompt[:prefix])
                elapsed, cached = _prefill_s(engine, ids, prompt)
                best = min(best, elapsed)
            points.append(PrefillPoint(n, cached, best))
        cold_s = max(p.time_s for p in points if p.input_len == n)  # its least cached point
        if grid.longest_prefill_s is not None and i >= 2 and cold_s > grid.longest_prefill_s:
            break
    return points


def _prefill_s(engine: Engine, ids: CountingIds, prompt: list[int]) -> tuple[float, int]:
    rid = ids.next_id()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1))
    start = time.perf_counter()
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens
    return time.perf_counter() - start, cached


def measure_decode(engine: Engine, grid: ProfileGrid, seed: int = 1,
                   max_batch_tokens: int | None = None) -> list[DecodePoint]:
    """Seconds of one decode step of `b` sequences of `c` context tokens each (a point whose
    batch would hold more than `max_batch_tokens` prompt tokens is left out).

    Every one of the `b` requests is still running in each timed step: a prompt set larger than
    the step's token budget prefills over several steps, while the requests prefilled first
    already decode, so each asks for enough tokens to outlive the prefill of the last one (a
    request that finished early made the point a smaller batch than it said: at 48 x 512
    tokens, ~12 sequences). They are aborted after the timing. Where the KV pool cannot hold
    the whole batch (preemption), the point says the batch and context that did run."""
    rng = np.random.default_rng(seed)
    ids = CountingIds("profile-decode")
    vocab = min(engine.model_config.vocab_size, 256)
    budget = engine.config.max_num_batched_tokens
    _decode_warm_up(engine)
    points = []
    for b in grid.decode_batch_sizes:
        for c in grid.decode_context_lens:
            if max_batch_tokens is not None and b * c > max_batch_tokens:
                continue
            prefill_steps = -(-b * c // max(1, budget - b)) + 1
            params = SamplingParams(max_tokens=prefill_steps + grid.repeats + 1, ignore_eos=True)
            rids = [ids.next_id() for _ in range(b)]
            for rid in rids:
                engine.add_request(rid, rng.integers(0, vocab, c).tolist(), params)
            while any(s.num_computed_tokens < s.num_prompt_tokens
                      for s in [*engine.batcher.waiting, *engine.batcher.running]):
                engine.step()
            best, ran = float("inf"), (b, b * c)
            for _ in range(grid.repeats):
                running = engine.batcher.running
                if len(running) != b:
                    ran = (len(running), sum(s.num_computed_tokens for s in running))
                start = time.perf_counter()
                engine.step()
                best = min(best, time.perf_counter() - start)
            for rid in rids:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            points.append(DecodePoint(ran[0], ran[1], best))
    return points


def _decode_warm_up(engine: Engine, steps: int = 4) -> None:
    """A few decode steps of one short request, untimed: on a fresh engine the first steps
    are slower (2026-12-07: the first point, 1 x 512 tokens, took 6.5 ms against 4.6 ms for
    1 x 2,048 right after it), which skewed the decode fit of an engine that prefilled nothing
    before (`benchmarks/live_profile_fit.refit_decode`)."""
    engine.add_request("profile-decode-warm-up", [1] * 16,
                       SamplingParams(max_tokens=steps, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_profile(model: str, engine_config: EngineConfig,
                grid: ProfileGrid | None = None) -> Profile:
    """Measure with torch's current thread count (set it first, as the workers do); without a
    grid, over the engine's prompts (`ProfileGrid.spanning`)."""
    import torch

    engine = Engine(model, engine_config)
    if grid is None:  # a prompt of n tokens and its one sampled token: n + 1 <= max_model_len
        grid = ProfileGrid.spanning(engine.max_model_len - 1, engine.num_blocks * engine.block_size)
    prefill = measure_prefill(engine, grid)
    longest = max(p.input_len for p in prefill)  # a timed grid: as long a batch as was affordable
    decode = measure_decode(engine, grid,
                            max_batch_tokens=longest if grid.longest_prefill_s else None)
    return Profile(engine.model_config.name, engine_config.dtype, torch.get_num_threads(),
                   PrefillTimePredictor.fit(prefill), DecodeStepPredictor.fit(decode),
                   prefill, decode)


def load_or_profile(model: str, engine_config: EngineConfig, cache_dir: Path | None = None,
                    grid: ProfileGrid | None = None, refresh: bool = False,
                    num_threads: int | None = None) -> Profile:
    """The cached profile of (model, dtype, torch threads, step token budget: `cache_path`),
    measured and cached if absent (or, with the default grid, if it is of an older format than
    PROFILE_FORMAT). `num_threads` (None:
    torch's current setting) is set for the measurement, as workers do."""
    import torch

    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    directory = cache_dir or default_cache_dir()
    path = cache_path(directory, model, engine_config.dtype, torch.get_num_threads(),
                      engine_config.max_num_batched_tokens)
    if path.is_file() and not refresh:
        try:
            cached = Profile.from_json(path.read_text())
            if cached.format >= PROFILE_FORMAT or grid is not None:
                return cached
        except (ValueError, KeyError, TypeError):
            pass  # a stale or damaged cache is measured again
    profile = run_profile(model, engine_config, grid)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two profilers at once: no clobbering
    tmp.write_text(profile.to_json())
    tmp.replace(path)
    return profile

"""The model's linear layers and the per-shape choice of the CPU GEMM behind them.

torch's default CPU GEMM (MKL in the CPU wheel) is not the fastest path for every shape on every
CPU: a decode step multiplies the weights by one or a few rows (a GEMV, bound by how fast the
weights are read), a prefill by thousands (a GEMM, bound by arithmetic), and which library wins
each depends on the CPU. So each distinct weight shape gets, per row-count bucket, the backend that
measured fastest on this machine (`tune`, at the first start-up; the choices are kept in a small
table per CPU, torch version and thread count, `table_path`), never a guess from the CPU's name:

- `aten`: `F.linear` (torch's default path);
- `aten_t`: `W @ x^T` (the same BLAS, the other orientation; faster for a few rows on some CPUs);
- `onednn`: the weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied by `mkldnn._linear_pointwise`;
- `mkl_gemv`: the weight packed once by MKL for exactly one row (`torch.ops.mkl._mkl_linear`);
  only in the one-row bucket. MKL runs it on the calling thread alone;
- `mkl_split`: the weight's rows split into one part per torch thread, each part packed by MKL
  for one row, the parts multiplied in one parallel region (`torch.ops.kvcake.split_gemv`,
  csrc/split_gemv.cpp), so every core reads its share of the weight; one-row bucket only, needs
  kvcake's CPU ops.

In the memory-bound buckets (at most COLD_ROWS rows) torch's default stays unless another
backend measures clearly faster; in the compute-bound ones (prefill chunks) the prepacked oneDNN
GEMM is the reference instead, and each is measured over more rounds (GEMM_MIN_ROUNDS, up to
GEMM_BUDGET_S): a table measured once on a busy machine is kept for good, and with a handful of
samples a noisy round had left a prefill's down_proj on MKL, 17% slower than oneDNN at 300 rows
on one thread (docs/benchmarks.md, issue 13 seventh session).

All of them run on torch's own thread pool (no second BLAS library). Every backend computes the
same product in fp32 with a different summation order (differences ~1e-6 relative; the engine's
logits stay within 1e-4 of transformers on each, tests/engine/test_linear.py). Only CPU fp32 is
tuned; other dtypes and devices always use `aten`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvcake.engine import cpu_ops
from kvcake.engine.config import LINEAR_MODES

BACKENDS = LINEAR_MODES[1:]  # ("aten", "aten_t", "onednn", "mkl_gemv", "mkl_split")
ONE_ROW = ("mkl_gemv", "mkl_split")  # backends packed for a product with exactly one row

# Row-count buckets: (upper bound of the bucket, the row count measured for it).
# The few-row buckets are measured at 2, 4 and 8 rows: one bucket for 2-8 measured at 4 rows had
# left batch-8 decode steps on a backend 10% slower in the engine than oneDNN's
# (docs/benchmarks.md, issue 13 decode side, eighth session).
BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (4, 4), (8, 8), (64, 16), (512, 256),
                                        (1 << 62, 1024))
BUCKET_NAMES = "1 | 2 | 3-4 | 5-8 | 9-64 | 65-512 | 513+"
# Buckets of at most this many rows are memory-bound (the weights are read once per call): they
# are timed with the caches flushed before each call, as in a real step, where the whole model's
# weights stream through the cache; a hot-cache loop would time the L3 instead.
COLD_ROWS = 8
FLUSH_BYTES = 64 << 20
# A bucket whose measurement would take more than this many multiply-adds per call (an lm_head
# on 1024 rows) takes the previous bucket's choice instead.
MAX_MACS = 1 << 31


_generation = [0]  # bumped whenever a layer's kernel or a kernel's choice changes


def generation() -> int:
    """A number that changes whenever any `Linear.kernel`, or a kernel's bound choice, does:
    what a cache of the kernels' operands (`Kernel.operands`) is keyed by."""
    return _generation[0]


def bucket_of(rows: int) -> int:
    if rows <= 1:  # the decode step of one sequence: the common case, no loop
        return 0
    for i, (upper, _) in enumerate(BUCKETS):
        if rows <= upper:
            return i
    return len(BUCKETS) - 1


def _available(backend: str) -> bool:
    if backend == "onednn":
        return torch.backends.mkldnn.is_available() and \
            hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    if backend in ONE_ROW:
        mkl = torch.backends.mkl.is_available() and \
            hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        return mkl and (backend == "mkl_gemv" or cpu_ops.load())
    return True


class Kernel:
    """One weight (and bias) with its prepacked forms and the backend chosen per bucket."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.choice: list[str] = ["aten"] * len(BUCKETS)
        self._onednn: Tensor | None = None
        self._mkl: Tensor | None = None
        self._split: tuple[list[Tensor], list[Tensor]] | None = None  # (packed, weight) parts
        self._fns: list[Callable[[Tensor], Tensor]] | None = None  # per bucket, see `bind`

    def prepare(self, backend: str) -> None:
        if backend == "onednn" and self._onednn is None:
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        elif backend == "mkl_gemv" and self._mkl is None:
            self._mkl = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)
        elif backend == "mkl_split" and self._split is None:
            parts = list(self.weight.chunk(max(1, torch.get_num_threads()), 0))  # row views
            self._split = ([torch.ops.mkl._mkl_reorder_linear_weight(p, 1) for p in parts],
                           parts)

    def drop_unused(self) -> None:
        """Free the packed forms no bucket chose, and bind the chosen ones."""
        if "onednn" not in self.choice:
            self._onednn = None
        if "mkl_gemv" not in self.choice:
            self._mkl = None
        if "mkl_split" not in self.choice:
            self._split = None
        self.bind()

    def bind(self) -> None:
        """One callable per bucket for `choice` (no backend lookup per call: a decode step
        makes ~17 of these calls, each a few microseconds of Python otherwise)."""
        self._fns = [self._fn(b) for b in self.choice]
        _generation[0] += 1

    def operands(self, bucket: int) -> tuple[int, Tensor | None, list[Tensor], list[Tensor]]:
        """What the C++ decode loop (`torch.ops.kvcake.decode_layers`) needs to make this
        product for `bucket`'s rows as `__call__` does: the backend's index in BACKENDS, the
        packed weight (onednn, mkl_gemv) and the split parts (mkl_split: packed, weight).
        ValueError if the chosen backend's packed form is missing."""
        backend = self.choice[bucket]
        packed = {"onednn": self._onednn, "mkl_gemv": self._mkl}.get(backend)
        if backend in ("onednn", "mkl_gemv") and packed is None \
                or backend == "mkl_split" and self._split is None:
            raise ValueError(f"linear kernel: {backend} chosen but not prepared")
        packs, parts = self._split if backend == "mkl_split" and self._split else ([], [])
        return BACKENDS.index(backend), packed, list(packs), list(parts)

    def _fn(self, backend: str) -> Callable[[Tensor], Tensor]:
        w, b = self.weight, self.bias
        if backend == "aten":
            return lambda x: F.linear(x, w, b)
        if backend == "onednn" and self._onednn is not None:
            packed = self._onednn
            op = cpu_ops.overload_callable(torch.ops.mkldnn._linear_pointwise.default)
            return lambda x: op(x, packed, b, "none", [], "")
        if backend == "mkl_gemv" and self._mkl is not None:
            packed = self._mkl
            op = cpu_ops.overload_callable(torch.ops.mkl._mkl_linear.default)
            return lambda x: op(x, packed, w, b, 1)
        if backend == "mkl_split" and self._split is not None:
            (packs, parts), split = self._split, cpu_ops.fused_ops().split_gemv
            return lambda x: split(x, packs, parts, b)
        return lambda x: self.run(x, backend)

    def run(self, x: Tensor, backend: str) -> Tensor:
        if backend == "aten":
            return F.linear(x, self.weight, self.bias)
        if backend == "aten_t":
            out = torch.mm(self.weight, x.t()).t().contiguous()
            return out if self.bias is None else out + self.bias
        if backend == "onednn":
            assert self._onednn is not None
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")
        if backend == "mkl_gemv":
            assert self._mkl is not None and x.shape[0] == 1
            return torch.ops.mkl._mkl_linear(x, self._mkl, self.weight, self.bias, 1)
        if backend == "mkl_split":
            assert self._split is not None and x.shape[0] == 1
            return cpu_ops.fused_ops().split_gemv(x, *self._split, self.bias)
        raise ValueError(f"linear backend {backend!r}: choose from {', '.join(BACKENDS)}")

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.shape[0]  # 0 rows: a step whose chunks all continue a prompt samples nothing
        if self._fns is None:
            self.bind()
        assert self._fns is not None
        if rows == 1:
            return self._fns[0](x)
        return self._fns[bucket_of(rows)](x) if rows else F.linear(x, self.weight, self.bias)


class Linear(nn.Linear):
    """`nn.Linear` whose forward goes through a tuned `Kernel` once `tune` gave it one."""

    _kernel: Kernel | None = None

    @property
    def kernel(self) -> Kernel | None:
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: Kernel | None) -> None:
        self._kernel = kernel
        _generation[0] += 1

    def forward(self, x: Tensor) -> Tensor:
        kernel = self._kernel
        if kernel is None:
            return F.linear(x, self.weight, self.bias)
        return kernel(x)


@dataclass(frozen=True)
class Choice:
    """What `tune` picked for one weight shape: backend per bucket, and each one's ms."""

    shape: tuple[int, int]
    backends: tuple[str, ...]
    ms: tuple[dict[str, float], ...]


def _eligible(backend: str, bucket: int) -> bool:
    return _available(backend) and (backend not in ONE_ROW or BUCKETS[bucket][1] == 1)


MIN_ROUNDS, MAX_ROUNDS, SLOW_ROUNDS, SLOW_CALL_S = 8, 200, 3, 0.005
MARGIN = 1.05
# Compute-bound buckets: more samples per backend (a few of them can all be disturbed on a busy
# machine), within at most this many seconds per bucket.
GEMM_MIN_ROUNDS, GEMM_BUDGET_S = 16, 0.4
# Part of the table's key: a change of how choices are measured (or of the candidates: 3 added
# `mkl_split`) measures them again.
TUNING_VERSION = 3


def tune(layers: Iterable[Linear], mode: str = "auto", *, budget_s: float = 0.05,
         clock: Callable[[], float] = time.perf_counter,
         table: Path | None = None) -> list[Choice]:
    """Give every layer a `Kernel`: `mode` a backend name forces it wherever it applies
    (`aten` elsewhere); "auto" measures each distinct (out, in) shape once per bucket, its
    backends interleaved, round after round (at least MIN_ROUNDS, then until `budget_s` is spent
    or MAX_ROUNDS), keeping each one's best time: on a busy machine a call whose thread lost
    its core is slow, and the minimum ignores it.
    `table`: a JSON file of earlier choices on this machine (`table_path()`): shapes found there
    are not measured again, new measurements are added to it.
    Layers not on CPU in fp32 get no kernel (plain `F.linear`). Returns the choices per shape."""
    if mode not in LINEAR_MODES:
        raise ValueError(f"linear backend {mode!r}: choose from {', '.join(LINEAR_MODES)}")
    groups: dict[tuple[int, int], list[Linear]] = {}
    for layer in layers:
        layer.kernel = None
        w = layer.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        groups.setdefault((w.shape[0], w.shape[1]), []).append(layer)
    choices = []
    known = _read_table(table) if mode == "auto" and table is not None else {}
    for shape, members in groups.items():
        kernels = [Kernel(m.weight.detach(), None if m.bias is None else m.bias.detach())
                   for m in members]
        key = f"{shape[0]}x{shape[1]}"
        if mode == "auto" and key in known:
            choice = Choice(shape, known[key], tuple({} for _ in BUCKETS))
        elif mode == "auto":
            choice = _measure(kernels[0], budget_s, clock)
            if table is not None:
                known[key] = choice.backends
                _write_table(table, known)
        else:
            picked = tuple(mode if _eligible(mode, b) else "aten" for b in range(len(BUCKETS)))
            choice = Choice(shape, picked, tuple({} for _ in BUCKETS))
        for layer, kernel in zip(members, kernels, strict=True):
            kernel.choice = list(choice.backends)
            for backend in set(choice.backends):
                kernel.prepare(backend)
            kernel.drop_unused()
            layer.kernel = kernel
        choices.append(choice)
    return choices


def table_path(directory: Path, num_threads: int) -> Path:
    """Where this machine's choices are kept: one file per CPU (model and feature flags), torch
    version and thread count, since each of them changes which backend wins."""
    cpu = ""
    try:
        cpu = "\n".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith(("model name", "flags")))
    except OSError:
        pass
    key = hashlib.sha256(f"{cpu}\n{torch.__version__}\n{BUCKETS}\n{TUNING_VERSION}".encode()
                         ).hexdigest()[:16]
    return directory / f"linear-{key}-t{num_threads}.json"


def _read_table(path: Path) -> dict[str, tuple[str, ...]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: tuple(v) for k, v in raw.items()
            if isinstance(v, list) and len(v) == len(BUCKETS) and all(b in BACKENDS for b in v)
            and all(_eligible(b, i) for i, b in enumerate(v))}


def _write_table(path: Path, table: dict[str, tuple[str, ...]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({k: list(v) for k, v in sorted(table.items())}, indent=1))
        tmp.replace(path)  # atomic: concurrent engines never read half a file
    except OSError:
        pass  # a read-only home: measure again next time


@torch.inference_mode()
def _measure(kernel: Kernel, budget_s: float, clock: Callable[[], float]) -> Choice:
    gen = torch.Generator().manual_seed(0)
    out_features, in_features = kernel.weight.shape
    picked: list[str] = []
    timings: list[dict[str, float]] = []
    scratch: Tensor | None = None
    for bucket, (_, rows) in enumerate(BUCKETS):
        if picked and rows * out_features * in_features > MAX_MACS:
            picked.append(picked[-1])
            timings.append({})
            continue
        cold = rows <= COLD_ROWS
        reference = "aten" if cold or not _available("onednn") else "onednn"
        if cold and scratch is None:
            scratch = torch.zeros(FLUSH_BYTES // 4)
        x = torch.randn(rows, in_features, generator=gen)
        candidates = [b for b in BACKENDS if _eligible(b, bucket)]
        t0 = clock()
        for backend in candidates:
            kernel.prepare(backend)
            kernel.run(x, backend)  # warm-up (first-call allocations, oneDNN primitive cache)
        slow = (clock() - t0) / len(candidates) > SLOW_CALL_S
        best = {b: float("inf") for b in candidates}
        start = clock()
        for done in range(MAX_ROUNDS):
            elapsed = clock() - start
            if cold and done >= (SLOW_ROUNDS if slow else MIN_ROUNDS) and elapsed > budget_s:
                break
            if not cold and (done >= GEMM_MIN_ROUNDS and elapsed > budget_s
                             or done >= SLOW_ROUNDS and elapsed > GEMM_BUDGET_S):
                break
            for backend in candidates:
                if scratch is not None and cold:
                    scratch.add_(1.0)  # flush: the weights come from memory, as in a step
                t0 = clock()
                kernel.run(x, backend)
                best[backend] = min(best[backend], clock() - t0)
        fastest = min(candidates, key=lambda b: best[b])
        # The reference stays unless another backend is clearly faster (not a coin toss).
        picked.append(fastest if best[fastest] * MARGIN < best[reference] else reference)
        timings.append({b: 1e3 * t for b, t in best.items()})
    kernel.choice = picked
    kernel.drop_unused()
    return Choice((out_features, in_features), tuple(picked), tuple(timings))

"""kvcake's CPU torch ops (`torch.ops.kvcake.*`), a small C++ library built here on first use.

- `csrc/paged_attention.cpp`: `paged_decode_attention`, decode attention that reads each
  sequence's K and V in place through its block table (no gathered copy of the context per layer
  per step);
- `csrc/prefill_attention.cpp`: `paged_prefill_attention` (fp32), causal attention of a prompt
  chunk over its sequence's paged KV in place (a cached prefix is not gathered, no mask tensor):
  register-blocked micro-GEMMs on the vector width this CPU has, an online softmax, work items
  spread over torch's threads;
- `csrc/fused_ops.cpp`: fp32 `rms_norm`, `add_rms_norm` (residual add + norm), `silu_mul`
  (SwiGLU's gate) and `rope_qkv_store` (RoPE on q and k, and the K/V write into the pool), each
  one pass on the calling thread instead of 2-8 eager kernels (fewer dispatches, and no parallel
  regions waiting for a descheduled thread on a busy machine);
- `csrc/split_gemv.cpp`: `split_gemv`, a one-row product whose weight parts (each packed by MKL
  for one row) are multiplied in one parallel region, one part per thread (linear.py's
  `mkl_split`);
- `csrc/decode_layers.cpp`: `decode_layers`, a pure decode step's decoder layers in one call
  (the fused layer's ops, each linear product on its tuned backend, made through the
  dispatcher instead of from Python: bit-identical results, ~45 fewer Python calls a step);
- `csrc/thread_bind.cpp`: `bind_threads`, each thread of the caller's intra-op pool bound to one
  CPU (as vLLM's CPU launcher binds its worker's OpenMP threads).

The library is compiled once per machine by the system C++
compiler (`$CXX`, else `c++`; Debian's g++) against the installed torch's headers, into
`$KVCAKE_EXT_DIR` (default `$KVCAKE_CACHE_DIR/ext`, i.e. `~/.cache/kvcake/ext`), under a name that hashes the source, the torch
version, the flags and this CPU's feature flags (`-march=native`), so a changed source, torch or
CPU gets a fresh build and nothing prebuilt is ever loaded. Concurrent builders (several worker
processes starting at once) serialise on a lock file. `python -m kvcake.engine.cpu_ops`
builds it ahead of time (the first engine would otherwise pay ~10-30 s once).

When the build fails (no compiler, no headers) `load()` returns False with the reason in
`load_error()`, and the engine runs eager torch ops and attends through the gather path instead
(the same results within float rounding).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_attention.cpp", "fused_ops.cpp", "prefill_attention.cpp",
                             "split_gemv.cpp", "thread_bind.cpp", "decode_layers.cpp"))
HEADER = SOURCES[0].with_name("fast_exp.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC",
         "-std=c++17", "-w")

_error: list[str] = []


def cache_dir() -> Path:
    """kvcake's per-machine cache: `$KVCAKE_CACHE_DIR`, default `~/.cache/kvcake`."""
    return Path(os.environ.get("KVCAKE_CACHE_DIR") or Path.home() / ".cache" / "kvcake")


def ext_dir() -> Path:
    return Path(os.environ.get("KVCAKE_EXT_DIR") or cache_dir() / "ext")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(out_dir: Path, compiler: str | None = None) -> Path:
    """Compile the op into `out_dir` (if not there yet) and return the library's path.
    RuntimeError with the compiler's output when it fails."""
    from torch.utils import cpp_extension

    cxx = compiler or os.environ.get("CXX") or "c++"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdirs = cpp_extension.library_paths()
    texts = [s.read_text() for s in (*SOURCES, HEADER)]
    key = hashlib.sha256("\n".join([*texts, torch.__version__, cxx,
                                    abi, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    target = out_dir / f"kvcake_ops-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if target.is_file():
            return target
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, *FLAGS, abi, f"-I{SOURCES[0].parent}", *includes, *map(str, SOURCES), *[f"-L{d}" for d in libdirs],
               *[f"-Wl,-rpath,{d}" for d in libdirs], "-lc10", "-ltorch_cpu", "-o", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{cxx}: {exc}") from None
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{cxx} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        tmp.replace(target)  # atomic: a reader never sees a half-written library
    return target


@cache
def load() -> bool:
    """Build (once) and load the op; False, with `load_error()` set, if that is impossible."""
    if hasattr(torch.ops.kvcake, "paged_decode_attention"):
        return True
    try:
        torch.ops.load_library(str(build(ext_dir())))
    except (RuntimeError, OSError) as exc:
        _error.append(str(exc))
        return False
    return True


def load_error() -> str | None:
    return _error[-1] if _error else None


@cache
def fused_ops() -> SimpleNamespace:
    """The ops' overloads (`torch.ops.kvcake.X.default`) as their C++ callables, bound once:
    calling one skips the overload packet's and the overload's Python `__call__` frames (~30
    calls a decode step). Needs `load()`."""
    ops = torch.ops.kvcake
    return SimpleNamespace(**{name: overload_callable(getattr(ops, name).default) for name in (
        "rms_norm", "add_rms_norm", "silu_mul", "argmax_rows", "rope_qkv_store",
        "paged_decode_attention", "paged_prefill_attention", "split_gemv", "decode_layers")})


def overload_callable(overload: Any) -> Callable[..., Any]:
    """The C++ callable behind an op overload (`torch.ops.NS.OP.default`): the same call as the
    overload's, without its Python `__call__` frame (which only forwards `*args, **kwargs`)."""
    return getattr(overload, "_op", overload)


def paged_decode_attention(q: Tensor, kv_layer: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float) -> Tensor:
    """q [B, Hq, D] (one query token per sequence) attending to its first context_lens[b]
    positions held in the blocks block_tables[b] of kv_layer [num_blocks, 2, block_size, Hkv,
    D] -> [B, Hq, D]. Needs `load()`."""
    return fused_ops().paged_decode_attention(q, kv_layer, block_tables, context_lens, scale)


def paged_prefill_supported(head_size: int, dtype: torch.dtype) -> bool:
    """Whether `paged_prefill_attention` runs this model's attention (fp32, a head size the
    kernel's vector blocking divides, ops loaded)."""
    return dtype == torch.float32 and load() and \
        head_size % torch.ops.kvcake.prefill_attention_head_multiple() == 0


def paged_prefill_attention(q: Tensor, kv_layer: Tensor, block_table: Tensor, ctx_len: int,
                            scale: float) -> Tensor:
    """q [n, Hq, D] (a chunk of one sequence's prompt at positions ctx_len - n .. ctx_len - 1)
    attending causally to that sequence's positions 0 .. its own, whose K and V are in the blocks
    block_table [>= ceil(ctx_len / block_size)] of kv_layer [num_blocks, 2, block_size, Hkv, D]
    (the chunk's own included) -> [n, Hq, D]. Needs `paged_prefill_supported`."""
    return fused_ops().paged_prefill_attention(q, kv_layer, block_table, ctx_len, scale)


def bind_threads(cpus: list[int]) -> list[int]:
    """Bind the calling thread's intra-op pool, thread i to cpus[i] (one CPU per thread of
    `torch.get_num_threads()`); per thread the CPU it is bound to, -1 where that failed. Needs
    `load()`; call it on the thread that runs the steps (OpenMP pools are per calling thread)."""
    return list(torch.ops.kvcake.bind_threads(cpus))


def main() -> int:
    """Build ahead of time (e.g. right after `pip install`)."""
    try:
        path = build(ext_dir())
    except RuntimeError as exc:
        print(f"kvcake CPU ops: build failed ({exc}); the engine will use eager torch ops "
              f"and the gather path", file=sys.stderr)
        return 1
    print(f"kvcake CPU ops: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def fused(t: Tensor) -> bool:
    """Whether the fused element-wise ops apply to `t` (CPU fp32, ops loaded)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and load()

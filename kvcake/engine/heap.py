"""The process heap's policy for a CPU engine: keep freed memory for the next step.

A prefill step of a 2,048-token chunk allocates and frees tens of MB of activations per layer
(gate|up alone is 2,048 x 2,816 floats, 23 MB). glibc's malloc serves such sizes with fresh
`mmap`s, or from per-thread arenas whose heaps (64 MB at most) are unmapped again when
emptied, and trims the main heap's top beyond a threshold: the next step faults every page back
in, zeroed by the kernel. Measured on the serving model's cold 2,048-token prefill (one thread,
docs/benchmarks.md): 10-30 thousand page faults and 18-78 ms of system time a step on the default
heap, ~0 and ~2 ms with `keep_freed_memory()`. (vLLM's CPU launcher preloads tcmalloc for the
same reason.)

`keep_freed_memory()` sets, once per process: one arena (`M_ARENA_MAX`; threads that have not
allocated yet, e.g. an engine thread started later, share the main heap, which is never
unmapped), no `mmap` below 32 MB (`M_MMAP_THRESHOLD`, glibc's maximum), and no trimming below
1 GiB of free top (`M_TRIM_THRESHOLD`). Freed memory is kept by the process and reused by the
next step; its peak stays what one step needs. Only on glibc; `KVCAKE_MALLOC_TUNING=0` leaves
the heap alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from functools import cache

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


@cache
def keep_freed_memory() -> bool:
    """Apply the policy above (once); True when it is in effect."""
    if os.environ.get("KVCAKE_MALLOC_TUNING", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))

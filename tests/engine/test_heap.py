"""The heap policy: memory freed by one step is reused by the next without page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from kvcake.engine import heap

# In a thread started after the policy (as the engine thread is): 4 x 20 MB live, freed, twice;
# prints the minor page faults of the second round.
SCRIPT = """
import ctypes, resource, sys, threading
from kvcake.engine import heap
if sys.argv[1] == "tuned":
    assert heap.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
faults = []
def rounds():
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(20 << 20) for _ in range(4)]
        for b in blocks:
            libc.memset(b, 1, 20 << 20)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=rounds)
t.start()
t.join()
print(faults[-1])
"""

needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


def _second_round_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=60, env={"PATH": "", "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@needs_glibc
def test_a_second_step_reuses_the_first_steps_memory() -> None:
    pages = 4 * (20 << 20) // 4096  # 20,480
    assert _second_round_faults("tuned") < pages // 20
    assert _second_round_faults("default") > pages // 2  # what the policy is for


def test_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCAKE_MALLOC_TUNING", "0")
    heap.keep_freed_memory.cache_clear()
    try:
        assert heap.keep_freed_memory() is False
    finally:
        heap.keep_freed_memory.cache_clear()

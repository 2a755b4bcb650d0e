"""`fault_in`: a store node's segment pages made resident before it takes any object.

A fresh segment's pages are only mapped when first written, and on this project's VMs a first
touch costs about 5-8 us per 4 KiB page: 16 faults, ~100-300 us, inside a 64 KiB put that lands
on new pages, against ~70 us for the whole write into resident ones (docs/benchmarks.md). A node
pays them once at start instead (`NodeConfig.prefault`), as memory registered for RDMA is pinned
up front: with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) where the kernel has it, else by
writing one byte per page (its own value: nothing in the segment changes).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only from 3.13 on


def fault_in(view: memoryview) -> str:
    """Make every page of `view` (writable) resident; returns how ("madvise" or "touch")."""
    if view.readonly:
        raise ValueError("view: must be writable memory (a segment's view)")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if not len(view):
        return "touch"
    if _populate(view):
        return "madvise"
    pages = np.frombuffer(view, dtype=np.uint8)[::mmap.PAGESIZE]
    pages += 0  # a write per page (of its own value) faults it in
    return "touch"


def _populate(view: memoryview) -> bool:
    """MADV_POPULATE_WRITE over the pages `view` spans; False where the kernel refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = address - address % mmap.PAGESIZE  # madvise wants a page-aligned start
    if madvise(start, len(view) + (address - start), MADV_POPULATE_WRITE) == 0:
        return True
    log.debug("madvise(MADV_POPULATE_WRITE) refused (errno %d): touching pages instead",
              ctypes.get_errno())
    return False

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcake.store.allocator import OffsetAllocator, OutOfSpace


def test_first_fit_and_alignment() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    assert alloc.allocate(1) == 0
    assert alloc.allocate(65) == 64
    assert alloc.allocate(64) == 192
    assert alloc.used_bytes == 256
    assert alloc.free_ranges() == [(256, 768)]


def test_free_coalesces_both_neighbours() -> None:
    alloc = OffsetAllocator(256, alignment=64)
    a, b, c, d = (alloc.allocate(64) for _ in range(4))
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_ranges() == [(0, 64), (128, 64)]
    alloc.free(b)  # joins a and c
    assert alloc.free_ranges() == [(0, 192)]
    alloc.free(d)
    assert alloc.free_ranges() == [(0, 256)]
    assert alloc.used_bytes == 0


def test_fragmentation_then_out_of_space() -> None:
    alloc = OffsetAllocator(256, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(4)]
    alloc.free(offsets[0])
    alloc.free(offsets[2])
    with pytest.raises(OutOfSpace):
        alloc.allocate(128)  # 128 bytes free in total, but not contiguous
    assert alloc.allocate(64) == 0


def test_bad_input() -> None:
    alloc = OffsetAllocator(256)
    with pytest.raises(ValueError, match="size_bytes"):
        alloc.allocate(0)
    with pytest.raises(ValueError, match="not an allocated range"):
        alloc.free(64)
    with pytest.raises(ValueError, match="capacity_bytes"):
        OffsetAllocator(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=60))
def test_ranges_never_overlap_and_all_free_coalesces(ops: list[tuple[bool, int]]) -> None:
    alloc = OffsetAllocator(4096, alignment=64)
    live: dict[int, int] = {}
    for do_free, size in ops:
        if do_free and live:
            offset = sorted(live)[size % len(live)]
            alloc.free(offset)
            del live[offset]
            continue
        try:
            offset = alloc.allocate(size)
        except OutOfSpace:
            continue
        live[offset] = alloc.aligned(size)
        spans = sorted(live.items())
        assert all(a + s <= b for (a, s), (b, _) in zip(spans, spans[1:], strict=False))
        assert spans[-1][0] + spans[-1][1] <= 4096
    assert alloc.used_bytes == sum(live.values())
    for offset in list(live):
        alloc.free(offset)
    assert alloc.free_ranges() == [(0, 4096)]

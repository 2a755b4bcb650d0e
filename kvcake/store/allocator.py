"""Offset allocator for one segment: first fit over a sorted free list, coalescing on free.

Pure bookkeeping of byte ranges; it never touches memory. Ranges are aligned to `alignment`.
"""

from __future__ import annotations

import bisect


class OutOfSpace(Exception):
    """No free range is large enough."""


class OffsetAllocator:
    def __init__(self, capacity_bytes: int, alignment: int = 64) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        # Free ranges sorted by offset, kept as two parallel lists for bisect.
        self._offsets: list[int] = [0]
        self._sizes: list[int] = [capacity_bytes]
        self._allocated: dict[int, int] = {}  # offset -> aligned size
        self.used_bytes = 0

    def aligned(self, size_bytes: int) -> int:
        return -(-size_bytes // self.alignment) * self.alignment

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        return max(self._sizes, default=0)

    def allocate(self, size_bytes: int) -> int:
        """Offset of a new range of at least `size_bytes`; raises OutOfSpace."""
        if size_bytes <= 0:
            raise ValueError(f"size_bytes: must be > 0, got {size_bytes}")
        need = self.aligned(size_bytes)
        for i, free in enumerate(self._sizes):
            if free >= need:
                offset = self._offsets[i]
                if free == need:
                    del self._offsets[i], self._sizes[i]
                else:
                    self._offsets[i] += need
                    self._sizes[i] -= need
                self._allocated[offset] = need
                self.used_bytes += need
                return offset
        raise OutOfSpace(f"no free range of {need} bytes (largest {self.largest_free_bytes})")

    def reserve(self, offset: int, size_bytes: int) -> None:
        """Take the exact range [offset, offset + aligned size) (a new master adopting what a
        node already holds); ValueError if any of it is not free or it is misaligned."""
        need = self.aligned(size_bytes)
        if size_bytes <= 0 or offset % self.alignment:
            raise ValueError(f"range: offset {offset} (size {size_bytes}) is not an aligned range")
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i < 0 or offset + need > self._offsets[i] + self._sizes[i]:
            raise ValueError(f"range: [{offset}, {offset + need}) is not free")
        start, size = self._offsets[i], self._sizes[i]
        del self._offsets[i], self._sizes[i]
        tail = start + size - (offset + need)
        if tail:
            self._offsets.insert(i, offset + need)
            self._sizes.insert(i, tail)
        if offset > start:
            self._offsets.insert(i, start)
            self._sizes.insert(i, offset - start)
        self._allocated[offset] = need
        self.used_bytes += need

    def free(self, offset: int) -> None:
        """Return the range at `offset`; merges it with free neighbours."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"offset: {offset} is not an allocated range")
        self.used_bytes -= size
        i = bisect.bisect_left(self._offsets, offset)
        merge_prev = i > 0 and self._offsets[i - 1] + self._sizes[i - 1] == offset
        merge_next = i < len(self._offsets) and offset + size == self._offsets[i]
        if merge_prev and merge_next:
            self._sizes[i - 1] += size + self._sizes[i]
            del self._offsets[i], self._sizes[i]
        elif merge_prev:
            self._sizes[i - 1] += size
        elif merge_next:
            self._offsets[i] = offset
            self._sizes[i] += size
        else:
            self._offsets.insert(i, offset)
            self._sizes.insert(i, size)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range, by offset."""
        return list(zip(self._offsets, self._sizes, strict=True))

"""`StageStores`: a block stored by a CPP group is listed only once every layer is in.

Each stage of a group stores its slice of a block's layers as its own object and reports it
(`StoreEvents(keys, layers=[lo, hi])`). The frontend must not tell the Conductor that the store
holds the block until the slices cover all `num_layers` layers: a fetch planned on a block that
is stored in part would read less than the plan said. `add` returns the keys that have just
become whole. Keys with some slices only are remembered up to `max_partial` (the oldest
dropped first: a stage whose write failed never completes them).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence


class StageStores:
    def __init__(self, num_layers: int, max_partial: int = 200_000) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers: must be >= 1, got {num_layers}")
        if max_partial < 1:
            raise ValueError(f"max_partial: must be >= 1, got {max_partial}")
        self.num_layers = num_layers
        self.max_partial = max_partial
        self._covered: dict[int, int] = {}  # key -> bitmask of its layers stored so far
        self._full = (1 << num_layers) - 1
        self.split: tuple[range, ...] = ()  # the slices reported so far, in layer order

    def __len__(self) -> int:
        return len(self._covered)

    def add(self, keys: Sequence[int], layers: Sequence[int]) -> list[int]:
        """Slices `layers` = [lo, hi] of `keys` are stored; returns the keys now whole."""
        if len(layers) != 2 or not 0 <= layers[0] < layers[1] <= self.num_layers:
            raise ValueError(f"layers: [lo, hi] with 0 <= lo < hi <= {self.num_layers}, "
                             f"got {list(layers)}")
        lo, hi = layers
        if range(lo, hi) not in self.split:
            self.split = tuple(sorted({*self.split, range(lo, hi)}, key=lambda r: r.start))
        bits = ((1 << hi) - 1) ^ ((1 << lo) - 1)
        whole = []
        for key in keys:
            covered = self._covered.pop(key, 0) | bits
            if covered == self._full:
                whole.append(key)
            else:
                self._covered[key] = covered  # (re)inserted last: the newest
        while len(self._covered) > self.max_partial:
            del self._covered[next(iter(self._covered))]
        return whole

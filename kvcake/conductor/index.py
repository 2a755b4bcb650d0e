"""Global index of block key -> holders (prefill instances and store tiers).

Each holder gets one bit; each key maps to the bitmask of its holders. Matching a request walks
its keys once, AND-ing the masks: a holder's prefix match ends at the first key it lacks, and the
walk stops as soon as no holder is left. That is one dict lookup and one int AND per block,
however many holders there are, done by itertools in C; Python-level work is per holder that
matched, not per block, which keeps the live path well under a millisecond.

A holder's match is the *contiguous* run of keys from the first one, as a prefix cache reuses
them: a holder that lacks key 3 but has key 4 matches 3 blocks.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat, takewhile
from operator import and_


@dataclass(frozen=True)
class PrefixMatch:
    """Matched blocks per holder (holders with 0 omitted) and the best of them.

    best_holder: the holder with the longest match; ties go to the lowest holder slot, which is
    registration order (a removed holder's slot is reused by the next new holder).
    None (with best_blocks 0) when nobody holds the first key.
    best_holders: every holder with the longest match, in that same order (the replicas a fetch
    may read from; `best_holders[0] == best_holder`).
    """

    blocks_by_holder: dict[str, int]
    best_blocks: int
    best_holder: str | None
    best_holders: tuple[str, ...] = ()

    def blocks(self, holder: str) -> int:
        return self.blocks_by_holder.get(holder, 0)


class GlobalIndex:
    """Which holders have which block keys. Adds and removes are idempotent."""

    def __init__(self) -> None:
        self._masks: dict[Hashable, int] = {}
        self._bit: dict[str, int] = {}
        self._holder_of_bit: dict[int, str] = {}
        # Only a count per holder, not its key set: a million-key set per holder would cost
        # memory and, rebuilt as it churns, millisecond pauses on the decision path.
        self._num_keys: dict[str, int] = {}
        self._free_bits: list[int] = []

    def add_holder(self, holder: str) -> None:
        """Register `holder` (done implicitly by `add`). Registration order breaks best-match ties."""
        if holder in self._bit:
            return
        bit = self._free_bits.pop() if self._free_bits else len(self._bit)
        self._bit[holder] = bit
        self._holder_of_bit[bit] = holder
        self._num_keys[holder] = 0

    def remove_holder(self, holder: str) -> None:
        """Forget `holder` and everything it held (a node that died, an instance removed).

        One pass over the whole index: rare, and it keeps adds and matches cheap."""
        if holder not in self._bit:
            return
        flag = 1 << self._bit[holder]
        self.remove(holder, [key for key, mask in self._masks.items() if mask & flag])
        bit = self._bit.pop(holder)
        del self._holder_of_bit[bit], self._num_keys[holder]
        self._free_bits.append(bit)

    @property
    def holders(self) -> list[str]:
        return sorted(self._bit, key=self._bit.__getitem__)

    def add(self, holder: str, keys: Iterable[Hashable]) -> None:
        self.add_holder(holder)
        flag = 1 << self._bit[holder]
        masks, added = self._masks, 0
        get = masks.get
        for key in keys:
            mask = get(key, 0)
            if not mask & flag:
                masks[key] = mask | flag
                added += 1
        self._num_keys[holder] += added

    def remove(self, holder: str, keys: Iterable[Hashable]) -> None:
        if holder not in self._bit:
            return
        flag = 1 << self._bit[holder]
        masks, removed = self._masks, 0
        for key in keys:
            mask = masks.get(key, 0)
            if mask & flag:
                removed += 1
                if mask == flag:
                    del masks[key]
                else:
                    masks[key] = mask ^ flag
        self._num_keys[holder] -= removed

    def holders_of(self, key: Hashable) -> list[str]:
        mask = self._masks.get(key, 0)
        return [h for h, bit in sorted(self._bit.items(), key=lambda kv: kv[1]) if mask >> bit & 1]

    def num_keys(self, holder: str) -> int:
        return self._num_keys.get(holder, 0)

    def __len__(self) -> int:
        """Distinct keys held by anyone."""
        return len(self._masks)

    def match(self, keys: Sequence[Hashable]) -> PrefixMatch:
        """Longest contiguous prefix of `keys` held by each holder, in one pass over the keys."""
        masks = self._masks
        # alive[i]: the holders that have keys[0..i], up to the first key nobody left has. The
        # running AND only clears bits, so alive is non-increasing as integers: the blocks a
        # holder set keeps are found by bisection, not by a Python loop over the keys.
        alive = list(takewhile(bool, accumulate(map(masks.get, keys, repeat(0)), and_)))
        if not alive:
            return PrefixMatch({}, 0, None, ())
        ascending = alive[::-1]
        num_alive = len(alive)
        holder_of_bit = self._holder_of_bit
        by_holder: dict[str, int] = {}
        end = 0
        while end < num_alive:
            run = alive[end]
            end = num_alive - bisect_left(ascending, run)  # blocks matched by the holders in run
            dropped = run & ~alive[end] if end < num_alive else run
            while dropped:  # lowest bit first: registration order
                low = dropped & -dropped
                by_holder[holder_of_bit[low.bit_length() - 1]] = end
                dropped ^= low
        # The last run matched the most blocks; ties go to its lowest bit.
        best: list[str] = []
        while run:
            low = run & -run
            best.append(holder_of_bit[low.bit_length() - 1])
            run ^= low
        return PrefixMatch(by_holder, end, best[0], tuple(best))

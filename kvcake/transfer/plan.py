"""Slicing and striping arithmetic. Pure: data in, data out.

A batch's requests are cut into slices of at most `slice_bytes`; slices are dealt round-robin over
the preferred rails of their segment, continuing from a cursor that the engine carries across
batches (so many one-slice requests still spread over every rail):

    request 0 (2.5 slices)       request 1 (1 slice)      preferred rails (0, 1), cursor 0
    [ s0 | s1 | s2 ]             [ s3 ]
      r0   r1   r0                 r1                      next cursor 4

A failed slice retries on the next rail of its order (preferred rails, then secondary ones),
wrapping around, so a retry avoids the rail that just failed whenever there is another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slice:
    request_index: int
    local_offset: int  # into the request's local buffer
    remote_offset: int  # into the remote segment
    length: int
    rail: int  # the rail of the first attempt


@dataclass(frozen=True)
class RailPreference:
    """Topology for one segment: rails to stripe over, and rails to fall back on."""

    preferred: tuple[int, ...]
    secondary: tuple[int, ...] = ()

    def order(self) -> tuple[int, ...]:
        return self.preferred + self.secondary


def validate_preference(pref: RailPreference, num_rails: int) -> None:
    rails = pref.order()
    if not pref.preferred:
        raise ValueError("rail preference needs at least one preferred rail")
    bad = [r for r in rails if not 0 <= r < num_rails]
    if bad:
        raise ValueError(f"rails {bad} do not exist; rails are 0..{num_rails - 1}")
    if len(set(rails)) != len(rails):
        raise ValueError(f"a rail appears twice in preferred {pref.preferred} + secondary {pref.secondary}")


def cut(length: int, slice_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of [0, length), each at most slice_bytes, the last one shorter."""
    return [(off, min(slice_bytes, length - off)) for off in range(0, length, slice_bytes)]


def plan_slices(requests: Sequence[tuple[int, int, RailPreference]], slice_bytes: int,
                cursor: int = 0) -> tuple[list[Slice], int]:
    """Slices of every (remote_offset, length, preference) request, and the cursor after them."""
    slices: list[Slice] = []
    for index, (remote_offset, length, pref) in enumerate(requests):
        for off, size in cut(length, slice_bytes):
            rail = pref.preferred[cursor % len(pref.preferred)]
            slices.append(Slice(index, off, remote_offset + off, size, rail))
            cursor += 1
    return slices, cursor


def retry_rail(pref: RailPreference, first_rail: int, attempt: int) -> int:
    """The rail of retry number `attempt` (1, 2, ...) of a slice that first went to first_rail."""
    order = pref.order()
    return order[(order.index(first_rail) + attempt) % len(order)]

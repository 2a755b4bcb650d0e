"""Pure: a request's KV blocks as contiguous runs, so one layer of many blocks moves as a few
transfer requests instead of one per block.

The KV pool is layer-major (`KVPool`): layer l of blocks b, b+1, ... sits at consecutive
`layer_nbytes` offsets, on both the prefill and the decode side. Where the source block ids and
the target block ids both step by one, the whole run of a layer is one contiguous range at each
end: one `TransferRequest` (the transfer engine cuts it into slices as it needs).
"""

from __future__ import annotations

from collections.abc import Sequence


def block_runs(src: Sequence[int], dst: Sequence[int], first: int,
               end: int) -> list[tuple[int, int, int]]:
    """(source block, target block, count) of the maximal runs of prompt blocks
    `first .. end - 1` (capped at both lists) whose source and target ids both step by one;
    blocks with a negative target (already cached on the decode side) are skipped."""
    out: list[tuple[int, int, int]] = []
    for i in range(max(first, 0), min(end, len(src), len(dst))):
        s, d = src[i], dst[i]
        if d < 0:
            continue
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((s, d, 1))
    return out

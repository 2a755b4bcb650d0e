"""Chunked pipeline parallelism (CPP, seed section VIII): groups and their predicted prefill time.

Every X consecutive instances of the prefill pool form a pipelined group (a remainder smaller
than X prefills alone). A long prompt is cut into chunks of C tokens (the paper: C >= 1,000);
each node of the group runs 1/X of the layers, and chunk j+1 enters stage 1 while chunk j is in
stage 2:

    node 1 | c0 | c1 | c2 | c3 |
    node 2      | c0 | c1 | c2 | c3 |
    node 3           | c0 | c1 | c2 | c3 |       (J = 4 chunks, X = 3 nodes)
               <-- (J + X - 1) stages -->

A stage is one chunk on 1/X of the layers, i.e. 1 / (J X) of the single-node prefill time, so
the group's prefill takes (J + X - 1) / (J X) of it: close to 1/X for long prompts.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence


def cpp_groups(pool: Sequence[str], num_nodes: int) -> tuple[tuple[str, ...], ...]:
    """The pool, in order, cut into consecutive groups of `num_nodes` (the remainder left out)."""
    if num_nodes < 2:
        return ()
    return tuple(tuple(pool[i:i + num_nodes]) for i in range(0, len(pool) - num_nodes + 1,
                                                             num_nodes))


def pipelined_prefill_s(single_node_s: float, new_tokens: int, num_nodes: int,
                        chunk_tokens: int) -> float:
    """A prefill of `new_tokens` predicted at `single_node_s` on one node, pipelined over
    `num_nodes` nodes in chunks of `chunk_tokens`: (J + X - 1) / (J X) of it."""
    if new_tokens <= 0:
        return single_node_s
    num_chunks = -(-new_tokens // chunk_tokens)
    return single_node_s * (num_chunks + num_nodes - 1) / (num_chunks * num_nodes)

"""A new master adopting what its nodes hold (rebuild.py), and the exact-range reserve under it."""

from __future__ import annotations

import pytest

from kvcake.store.allocator import OffsetAllocator
from kvcake.store.config import MasterConfig
from kvcake.store.errors import InvalidRequest
from kvcake.store.index import StoreIndex
from kvcake.store.rebuild import adopt


def test_reserve_takes_the_exact_range_and_frees_back() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    alloc.reserve(128, 100)  # aligned to 128 bytes: [128, 256)
    assert alloc.free_ranges() == [(0, 128), (256, 768)]
    assert alloc.used_bytes == 128
    with pytest.raises(ValueError, match="not free"):
        alloc.reserve(192, 64)
    with pytest.raises(ValueError, match="aligned"):
        alloc.reserve(30, 64)
    assert alloc.allocate(64) == 0
    alloc.free(128)
    assert alloc.free_ranges() == [(64, 960)]


def _index() -> StoreIndex:
    index = StoreIndex(MasterConfig())
    for node_id in ("a", "b"):
        index.register_node(node_id, 4096, 0, {"segment": {}}, 0.0)
    return index


def test_adopt_rebuilds_objects_at_their_offsets_and_versions() -> None:
    index = _index()
    assert adopt(index, "a", [["k1", 0, 128, 7, 90, 1111], ["k2", 128, 64, 9, 10, 2222]], 0.0) == 2
    assert adopt(index, "b", [["k1", 512, 128, 8, 90, 1111]], 0.0) == 1  # a second replica
    k1 = index.get("k1", 1.0)
    assert k1.committed and k1.checksum == 1111 and k1.size_bytes == 90
    assert sorted((r.node_id, r.offset, r.version) for r in k1.dram()) == [("a", 0, 7), ("b", 512, 8)]
    assert index.stats()["num_objects"] == 2
    # New allocations take free space and versions above every adopted one.
    replicas = index.put_start("k3", 10, 3, 1, "a", 2.0)
    assert replicas[0].version > 9
    assert replicas[0].offset not in (0, 128) or replicas[0].node_id == "b"


def test_adopt_skips_clashes_and_rejects_malformed_entries() -> None:
    index = _index()
    adopt(index, "a", [["k", 0, 128, 1, 90, 5]], 0.0)
    # same key, other checksum: skipped; a range already taken: skipped; the good one counts
    assert adopt(index, "b", [["k", 0, 128, 2, 90, 6], ["m", 0, 128, 3, 90, 7],
                              ["n", 0, 128, 4, 90, 8]], 0.0) == 1
    assert [r.node_id for r in index.get("k", 1.0).dram()] == ["a"]
    assert index.exists("m") and not index.exists("n")
    assert adopt(index, "a", [["x", 0, 128, 5, 90, 9]], 0.0) == 0  # [0, 128) is k's
    with pytest.raises(InvalidRequest, match="alloc_bytes"):
        adopt(index, "a", [["y", 1024, 40, 6, 90, 1]], 0.0)
    with pytest.raises(InvalidRequest, match="objects: each must be"):
        adopt(index, "a", [["y", -1, 128, 6, 90, 1]], 0.0)
    with pytest.raises(InvalidRequest, match="must register"):
        adopt(index, "zz", [], 0.0)

"""A block a CPP group stores (one layer slice per stage) is listed under holder "store" only
once every layer is in (stage_stores.py, router.py), and the store audit checks it by its
slices (store_audit.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from kvcake.conductor import ConductorConfig
from kvcake.server.cluster.router import STORE_HOLDER, Router
from kvcake.server.cluster.stage_stores import StageStores
from kvcake.server.cluster.store_audit import StoreAudit
from kvcake.server.worker.block_fetch import range_key
from kvcake.server.worker.messages import StoreEvents
from tests.server.cluster.fakes import DECODE, PREFILL, hello


def test_a_block_is_whole_once_its_slices_cover_every_layer() -> None:
    stores = StageStores(num_layers=12)
    assert stores.add([1, 2], [0, 6]) == []
    assert len(stores) == 2 and stores.split == (range(0, 6),)
    assert stores.add([2, 3], [6, 12]) == [2]  # 1 and 3 have half their layers only
    assert stores.add([1], [0, 6]) == []  # the same slice again completes nothing
    assert stores.add([3, 1], [0, 6]) == [3]
    assert stores.add([1], [6, 12]) == [1]
    assert len(stores) == 0 and stores.split == (range(0, 6), range(6, 12))


def test_partial_blocks_are_bounded_and_bad_slices_refused() -> None:
    stores = StageStores(num_layers=4, max_partial=2)
    stores.add([1, 2, 3], [0, 2])  # 1 is dropped: over max_partial
    assert len(stores) == 2
    assert stores.add([1, 2], [2, 4]) == [2]  # 1 lost its first half: never listed
    with pytest.raises(ValueError, match=r"layers: \[lo, hi\] with 0 <= lo < hi <= 4"):
        stores.add([1], [2, 5])
    with pytest.raises(ValueError, match="num_layers: must be >= 1"):
        StageStores(num_layers=0)


def router(audit: StoreAudit | None = None) -> Router:
    # fakes.hello: 2 layers; a group of 2 stages stores layer 0 and layer 1 apart
    hellos = [hello("prefill-0", "prefill"), hello("decode-1", "decode")]
    return Router.for_workers(ConductorConfig(), hellos, PREFILL, DECODE, audit)


def in_store(r: Router, keys: Sequence[int]) -> int:
    return dict(r.conductor.index.match(list(keys)).blocks_by_holder).get(STORE_HOLDER, 0)


def test_the_conductor_sees_a_group_block_only_when_every_stage_stored_it() -> None:
    audit = StoreAudit("ns", max_keys=10)
    r = router(audit)
    assert r.store_layer_bounds() == []
    r.on_store_events(StoreEvents([11, 12], [1, 2]))  # the last stage came first
    assert in_store(r, [11, 12]) == 0 and len(audit) == 0
    assert r.store_layer_bounds() == []  # layer 0's slice not seen yet: no split to read
    r.on_store_events(StoreEvents([11], [0, 1]))
    assert in_store(r, [11, 12]) == 1 and len(audit) == 1
    assert r.store_layer_bounds() == [0, 1, 2]
    r.on_store_events(StoreEvents([12]))  # a whole block (a prefill worker's) at once
    assert in_store(r, [11, 12]) == 2
    assert audit.store_names(11) == [audit.store_key(11), range_key("ns", 11, range(0, 1)),
                                     range_key("ns", 11, range(1, 2))]
    assert audit.store_names(12) == [audit.store_key(12)]


def test_the_audit_keeps_a_sliced_block_while_all_its_slices_are_stored() -> None:
    audit = StoreAudit("ns", max_keys=10)
    audit.track([1, 2, 3], [range(0, 1), range(1, 2)])
    stored = {range_key("ns", 1, range(0, 1)), range_key("ns", 1, range(1, 2)),
              range_key("ns", 2, range(0, 1)),  # 2 lost its second slice
              audit.store_key(3)}  # 3 is also stored whole, its slices evicted
    reported: list[list[int]] = []
    gone = audit.run_round(lambda names: [n in stored for n in names], threading.Lock(),
                           reported.append)
    assert gone == [2] and reported == [[2]] and len(audit) == 2
    assert range_key("ns", 1, range(0, 2)) == audit.store_key(1) + "@0-2"
    with pytest.raises(ValueError, match="layers: a contiguous, non-empty range"):
        range_key("ns", 1, range(3, 3))

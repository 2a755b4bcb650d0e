"""Replica descriptors to transfer requests: segment descriptors are built once per node."""

from __future__ import annotations

import pytest

from kvcake.store.replica_io import segment_of
from kvcake.transfer import SegmentDesc

DESC = {"name": "store-n0", "segment_id": 3, "length_bytes": 1 << 20,
        "address": "127.0.0.1:9", "host_id": "h", "shm_name": None}


def test_a_segment_descriptor_is_built_once_and_equals_from_dict() -> None:
    first = segment_of(dict(DESC))
    assert first == SegmentDesc.from_dict(DESC)
    assert segment_of(dict(DESC)) is first  # the same node's descriptor again: no new object
    other = segment_of({**DESC, "segment_id": 4})
    assert other.segment_id == 4 and other is not first


def test_a_bad_segment_descriptor_is_refused_as_before() -> None:
    with pytest.raises(ValueError, match="lacks field 'address'"):
        segment_of({k: v for k, v in DESC.items() if k != "address"})
    with pytest.raises(TypeError):  # an unhashable field is not cached, from_dict judges it
        segment_of({**DESC, "segment_id": [3]})

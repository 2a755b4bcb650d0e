"""`read_layers` (block_fetch.py): the layers a reader needs of each block, from a CPP stage's
slice objects or a whole block, put together from slices for a whole-model reader; a block held
in neither form reads as None."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcake.server.worker.block_fetch import (
    StoredLayout,
    block_key,
    range_key,
    read_layers,
    readable_by_all,
)
from kvcake.store import StoreClient

NS = "ns"
LAYER = 64  # bytes of one layer of one block
LAYERS = 4
SPLIT = (range(0, 3), range(3, 4))  # a group of 2 stages, 3 + 1 layers
GROUP = StoredLayout(NS, LAYER, LAYERS, SPLIT)
WHOLE = StoredLayout(NS, LAYER, LAYERS)


def block(key: int) -> bytes:
    return bytes((key * 7 + i) % 251 for i in range(LAYERS * LAYER))


def part(key: int, layers: range) -> bytes:
    return block(key)[layers.start * LAYER:layers.stop * LAYER]


@pytest.fixture
def store() -> Iterator[StoreClient]:
    client = StoreClient.embedded(1 << 20)
    try:
        client.put(block_key(NS, 1), block(1))  # whole (a prefill worker's)
        for r in SPLIT:  # 2: both slices; 3: the first slice only
            client.put(range_key(NS, 2, r), part(2, r))
        client.put(range_key(NS, 3, SPLIT[0]), part(3, SPLIT[0]))
        yield client
    finally:
        client.close()


def test_a_stage_reads_its_slice_or_its_part_of_a_whole_block(store: StoreClient) -> None:
    read = read_layers(store, GROUP, [2, 1, 3, 4], SPLIT[0])
    assert read.sizes == [3 * LAYER] * 3 + [None]
    assert [bytes(b) for b in read.buffers[:3]] == [part(k, SPLIT[0]) for k in (2, 1, 3)]
    assert read.nbytes == 2 * 3 * LAYER + LAYERS * LAYER  # two slices, one whole block
    last = read_layers(store, GROUP, [2, 3], SPLIT[1])
    assert last.sizes == [LAYER, None] and bytes(last.buffers[0]) == part(2, SPLIT[1])


def test_a_whole_model_reader_puts_the_slices_together(store: StoreClient) -> None:
    read = read_layers(store, GROUP, [1, 2, 3], range(LAYERS))
    assert read.sizes == [LAYERS * LAYER, LAYERS * LAYER, None]  # 3 lacks its last layer
    assert [bytes(b) for b in read.buffers[:2]] == [block(1), block(2)]
    unsplit = read_layers(store, WHOLE, [1, 2], range(LAYERS))
    assert unsplit.sizes == [LAYERS * LAYER, None]  # no split known: whole blocks only
    with pytest.raises(ValueError, match=r"want: layers in \[0, 4\)"):
        read_layers(store, WHOLE, [1], range(2, 5))


def test_the_first_stage_reuses_only_what_every_stage_can_read(store: StoreClient) -> None:
    """Block 3's second slice is not stored (evicted, or its stage's write failed): the first
    stage, which read its own slice of it, stops the group's prefix before it."""
    read = read_layers(store, GROUP, [2, 1, 3, 2], SPLIT[0])
    assert read.sizes == [3 * LAYER] * 4
    sizes = readable_by_all(store, GROUP, [2, 1, 3, 2], read.sizes, SPLIT[0])
    assert sizes == [3 * LAYER, 3 * LAYER, None, None]
    assert readable_by_all(store, GROUP, [2], [None], SPLIT[0]) == [None]


def test_a_layout_without_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="layer_nbytes and num_layers must be >= 1"):
        StoredLayout(NS, 0, LAYERS)

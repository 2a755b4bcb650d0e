"""A prefix's KV blocks read from the store into fresh buffers, on a fetcher thread (the prefill
worker's and a CPP stage's). A failed read is logged and reads as nothing stored: the caller
recomputes.

Two kinds of objects hold a block's KV, both every layer's K|V in layer order:
- the whole block, `namespace:key_hex` (`StoreWriter`: a prefill or decode worker's);
- one layer slice of it, `namespace:key_hex@lo-hi` (layers lo..hi-1; `range_key`): what a CPP
  stage writes, since a stage holds only its layers (`StageStoreWriter`). The frontend lists a
  block as stored only once the slices of all its layers are in (`StageStores`).

`read_layers` reads the layers a reader needs of each block: a CPP stage its own slice (the
slice object, else the whole block's part of it: half the bytes of a whole block on a 2-stage
group), a whole-model reader every layer (the whole object, else the slices of a group's split
put together).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvcake.hashing import key_hex
from kvcake.store import StoreClient, StoreError
from kvcake.transfer import TransferError
from kvcake.types import BlockKey

log = logging.getLogger(__name__)


def block_key(namespace: str, key: int) -> str:
    """The store key of a whole block."""
    return f"{namespace}:{key_hex(BlockKey(key))}"


def range_key(namespace: str, key: int, layers: range) -> str:
    """The store key of a block's layers `layers` (a CPP stage's slice)."""
    if layers.step != 1 or len(layers) < 1:
        raise ValueError(f"layers: a contiguous, non-empty range, got {layers}")
    return f"{block_key(namespace, key)}@{layers.start}-{layers.stop}"


@dataclass(frozen=True)
class StoredLayout:
    """How a namespace's blocks lie in the store: `num_layers` layers of `layer_nbytes` each,
    and the layer slices a CPP group's stages write (`split`, empty: whole blocks only)."""

    namespace: str
    layer_nbytes: int
    num_layers: int
    split: tuple[range, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_nbytes < 1 or self.num_layers < 1:
            raise ValueError(f"StoredLayout: layer_nbytes and num_layers must be >= 1, got "
                             f"{self.layer_nbytes} and {self.num_layers}")


@dataclass(frozen=True)
class BlocksRead:
    """What was read: each block's size (None: not in the store), its buffer, the wall time,
    and the bytes moved."""

    sizes: list[int | None]
    buffers: list[bytearray]
    seconds: float
    nbytes: int = 0


def read_layers(store: StoreClient, layout: StoredLayout, keys: list[int], want: range,
                reader: str = "") -> BlocksRead:
    """Layers `want` of each block of `keys`, each block's in one buffer (layer order); a block's
    size is `len(want) * layer_nbytes`, None where neither kind of object holds it intact.

    `layout.split`: the layer slices CPP stages write (one group's `split_layers`). A `want`
    that is one of them reads that slice object first, else the whole block; a `want` of every
    layer reads the whole block first, else all slices of the split. At most two store batches."""
    namespace, layer_nbytes, num_layers, split = (layout.namespace, layout.layer_nbytes,
                                                  layout.num_layers, layout.split)
    if not 0 <= want.start < want.stop <= num_layers or want.step != 1:
        raise ValueError(f"want: layers in [0, {num_layers}), got {want}")
    size = len(want) * layer_nbytes
    whole = num_layers * layer_nbytes
    start = time.perf_counter()
    moved = 0
    buffers = [bytearray(size) for _ in keys]
    sizes: list[int | None] = [None] * len(keys)
    own = want if want in split else None
    if own is not None:  # a stage's own slice: its objects first
        got = _get(store, [range_key(namespace, k, own) for k in keys], buffers, reader)
        for i, n in enumerate(got):
            if n == size:
                sizes[i] = size
                moved += n
    missing = [i for i, n in enumerate(sizes) if n is None]
    if missing:  # whole blocks (only this stage's part of them kept)
        scratch = [bytearray(whole) for _ in missing] if size != whole \
            else [buffers[i] for i in missing]
        got = _get(store, [block_key(namespace, keys[i]) for i in missing], scratch, reader)
        for i, buf, n in zip(missing, scratch, got, strict=True):
            if n == whole:
                if buf is not buffers[i]:
                    buffers[i][:] = memoryview(buf)[want.start * layer_nbytes:
                                                    want.stop * layer_nbytes]
                sizes[i] = size
                moved += n
    missing = [i for i, n in enumerate(sizes) if n is None]
    parts = [r for r in split if r.start >= want.start and r.stop <= want.stop]
    if missing and own is None and sum(map(len, parts)) == len(want):  # put slices together
        names, views, spans = [], [], []
        for i in missing:
            view = memoryview(buffers[i])
            for r in parts:
                lo = (r.start - want.start) * layer_nbytes
                names.append(range_key(namespace, keys[i], r))
                views.append(view[lo:lo + len(r) * layer_nbytes])
                spans.append(len(r) * layer_nbytes)
        got = _get(store, names, views, reader)
        for j, i in enumerate(missing):
            mine = got[j * len(parts):(j + 1) * len(parts)]
            span = spans[j * len(parts):(j + 1) * len(parts)]
            if mine == span:
                sizes[i] = size
            moved += sum(n for n in mine if n is not None)
    return BlocksRead(sizes, buffers, time.perf_counter() - start, moved)


def readable_by_all(store: StoreClient, layout: StoredLayout, keys: list[int],
                    sizes: list[int | None], own: range, reader: str = "") -> list[int | None]:
    """`sizes` cut at the first block the other stages of a group could not read: neither its
    whole object nor every other slice of `split` is stored. The first stage sets the prefix the
    whole group reuses, and a stage that read less fails the request: the store evicts objects
    one by one, so one stage's slice may be gone while this one's is not."""
    namespace = layout.namespace
    end = next((i for i, n in enumerate(sizes) if n is None), len(sizes))
    others = [r for r in layout.split if r != own]
    if end == 0 or not others:
        return list(sizes)
    names = [name for k in keys[:end]
             for name in (block_key(namespace, k), *(range_key(namespace, k, r) for r in others))]
    try:
        found = store.exists_batch(names)
    except (StoreError, TransferError, OSError, ValueError) as exc:
        log.warning("%s: could not check %d blocks for the group, recomputing: %s", reader,
                    end, exc)
        return [None] * len(sizes)
    width = 1 + len(others)
    out = list(sizes)
    for i in range(end):
        mine = found[i * width:(i + 1) * width]
        if not (mine[0] or all(mine[1:])):
            out[i:] = [None] * (len(sizes) - i)
            break
    return out


def _get(store: StoreClient, names: list[str], buffers: Sequence[object],
         reader: str) -> list[int | None]:
    if not names:
        return []
    try:
        return store.get_batch_into(names, buffers)
    except (StoreError, TransferError, OSError, ValueError) as exc:
        log.warning("%s: fetch of %d blocks failed, recomputing: %s", reader, len(names), exc)
        return [None] * len(names)

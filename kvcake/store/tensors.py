"""A CPU tensor as one store object: u32 length of a msgpack map {dtype, shape}, then the bytes.

Written by `StoreClient.put_tensor`, read back by `StoreClient.get_tensor`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgpack

from kvcake.store.errors import InvalidRequest
from kvcake.transfer import buffer_view

if TYPE_CHECKING:
    import torch


def pack_tensor(tensor: torch.Tensor) -> bytes:
    """The object's bytes for `tensor` (detached, made contiguous; ValueError naming `tensor`
    if its memory cannot be viewed, e.g. on a GPU)."""
    tensor = tensor.detach().contiguous()
    meta = msgpack.packb({"dtype": str(tensor.dtype).removeprefix("torch."),
                          "shape": list(tensor.shape)})
    body = buffer_view(tensor, field="tensor")
    return len(meta).to_bytes(4, "little") + meta + bytes(body)


def unpack_tensor(key: str, data: bytes) -> torch.Tensor:
    """The tensor `pack_tensor` made `data` from; InvalidRequest naming `key` if it was not."""
    import torch

    meta_len = int.from_bytes(data[:4], "little")
    try:
        meta = msgpack.unpackb(data[4:4 + meta_len])
        dtype = getattr(torch, meta["dtype"])
        shape = tuple(meta["shape"])
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException):
        raise InvalidRequest(f"key {key!r} was not stored with put_tensor") from None
    flat = torch.frombuffer(bytearray(data[4 + meta_len:]), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)

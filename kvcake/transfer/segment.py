"""Registered memory segments: a name, an id, a base buffer and a length.

A `Segment` is memory this process owns and serves. A `SegmentDesc` is the plain-data description
of a segment anywhere in the cluster (what the store master hands out): enough for a peer's engine
to reach it over TCP, or to map it directly when it is shared memory on the same host.
"""

from __future__ import annotations

import functools
import mmap
import os
import socket
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

SHM_DIR = "/dev/shm"


@functools.cache
def local_host_id() -> str:
    """Identifies this host (hostname + boot id): equal ids mean shared memory is reachable."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{socket.gethostname()}/{boot_id}"


@dataclass(frozen=True)
class SegmentDesc:
    """Where a segment lives. Plain data: `to_dict()` / `from_dict()` survive msgpack and JSON.

    name: unique within its owner engine. segment_id: the owner's wire id for it.
    address: "host:port" of the owner's segment server ("" when the owner does not serve).
    shm_name: the shared-memory block backing it, when it is one (same-host peers map it).
    host_id: `local_host_id()` of the owner.
    """

    name: str
    segment_id: int
    length_bytes: int
    address: str
    host_id: str
    shm_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "segment_id": self.segment_id,
                "length_bytes": self.length_bytes, "address": self.address,
                "host_id": self.host_id, "shm_name": self.shm_name}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SegmentDesc:
        try:
            return cls(name=str(values["name"]), segment_id=int(values["segment_id"]),
                       length_bytes=int(values["length_bytes"]), address=str(values["address"]),
                       host_id=str(values["host_id"]), shm_name=values.get("shm_name"))
        except KeyError as e:
            raise ValueError(f"segment descriptor lacks field {e.args[0]!r}: {values!r}") from None


def buffer_view(buffer: Any, *, writable: bool = False, field: str = "buffer") -> memoryview:
    """A flat byte memoryview over `buffer` without copying.

    Accepts bytes/bytearray/memoryview, numpy arrays, CPU torch tensors (any dtype, through their
    storage) and `SharedMemory` blocks. Non-contiguous memory and GPU tensors are rejected with a
    ValueError naming `field`, since a copy would silently break zero-copy transfers.
    """
    if isinstance(buffer, shared_memory.SharedMemory):
        buffer = buffer.buf
    elif type(buffer).__module__.startswith("torch"):
        buffer = _torch_bytes(buffer, field)
    if isinstance(buffer, np.ndarray) and not buffer.flags.c_contiguous:
        raise ValueError(f"{field}: numpy array must be C-contiguous (use np.ascontiguousarray)")
    try:
        view = memoryview(buffer)
    except TypeError:
        raise ValueError(
            f"{field}: {type(buffer).__name__} is not a buffer; pass bytes, bytearray, a numpy "
            f"array, a CPU torch tensor or a SharedMemory") from None
    if not view.c_contiguous:
        raise ValueError(f"{field}: memory must be contiguous")
    if writable and view.readonly:
        raise ValueError(f"{field}: a read needs a writable destination (got read-only memory)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _torch_bytes(tensor: Any, field: str) -> np.ndarray:
    if tensor.device.type != "cpu":
        raise ValueError(f"{field}: tensor is on {tensor.device}; register CPU memory only")
    if not tensor.is_contiguous():
        raise ValueError(f"{field}: tensor must be contiguous (call .contiguous())")
    import torch  # only reached for torch inputs: keeps torch off this module's import path

    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)


class Segment:
    """Memory registered with one engine: served to peers, and usable as a local buffer.

    The engine keeps the memory alive (a reference to the object it was registered from) until the
    segment is unregistered; when it created the shared memory itself it also unlinks it then.
    """

    def __init__(self, name: str, segment_id: int, memory: Any, *,
                 owned_shm: SharedBlock | None = None) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"segment name must be a non-empty string, got {name!r}")
        self.name = name
        self.segment_id = segment_id
        self._memory = memory  # keeps the exporter alive while views exist
        self._owned_shm = owned_shm
        self.view = buffer_view(memory, writable=True, field=f"segment {name!r}")
        if len(self.view) == 0:
            raise ValueError(f"segment {name!r} has zero length; register a non-empty buffer")
        self.shm_name: str | None = None
        if owned_shm is not None:
            self.shm_name = owned_shm.name

        elif isinstance(memory, shared_memory.SharedMemory):
            self.shm_name = memory.name

    @property
    def length_bytes(self) -> int:
        return len(self.view)

    @property
    def array(self) -> np.ndarray:
        """The segment as a writable uint8 numpy array (no copy)."""
        return np.frombuffer(self.view, dtype=np.uint8)

    def desc(self, address: str) -> SegmentDesc:
        return SegmentDesc(name=self.name, segment_id=self.segment_id,
                           length_bytes=self.length_bytes, address=address,
                           host_id=local_host_id(), shm_name=self.shm_name)

    def release(self) -> None:
        """Unlink the shared memory this segment created (mappings stay valid until dropped)."""
        if self._owned_shm is not None:
            self._owned_shm.unlink()


def private_block(length_bytes: int) -> mmap.mmap:
    """Zeroed, page-aligned memory private to this process (anonymous mmap), with transparent
    huge pages asked for where the kernel offers them."""
    if length_bytes <= 0:
        raise ValueError(f"length_bytes must be positive, got {length_bytes}")
    block = mmap.mmap(-1, length_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # not offered by this kernel: plain pages
            pass
    return block


def block_prefix(pid: int) -> str:
    """The name every shared-memory block process `pid` creates starts with."""
    return f"kvcake-{pid}-"


def unlink_blocks_of(pid: int) -> list[str]:
    """Unlink the shared-memory blocks a dead process `pid` left (whoever reaped it calls this;
    mappings still open elsewhere keep their memory). Returns the names removed."""
    prefix, removed = block_prefix(pid), list[str]()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class SharedBlock:
    """A named POSIX shared-memory block this process creates, maps and finally unlinks.

    Mapped with mmap directly rather than through `SharedMemory`, whose close() fails (and whose
    finaliser complains) while any view of the memory is still alive; the resource tracker still
    unlinks the block if this process dies without closing.
    """

    def __init__(self, length_bytes: int) -> None:
        if length_bytes <= 0:
            raise ValueError(f"length_bytes must be positive, got {length_bytes}")
        self.name = f"{block_prefix(os.getpid())}{os.urandom(6).hex()}"
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, length_bytes)
            self.mapping = mmap.mmap(fd, length_bytes)
        except OSError:
            os.unlink(os.path.join(SHM_DIR, self.name))
            raise
        finally:
            os.close(fd)
        resource_tracker.register("/" + self.name, "shared_memory")

    def unlink(self) -> None:
        """Remove the name; the memory lives on until the last mapping of it goes."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            return
        resource_tracker.unregister("/" + self.name, "shared_memory")

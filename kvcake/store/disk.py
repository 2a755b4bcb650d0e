"""A node's SSD tier: one file per demoted object, named by its disk version.

The master does the space accounting; this class only moves bytes between the node's own DRAM
segment and files, and refuses a copy whose source is not the object it was asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvcake.store.layout import HEADER_BYTES, CorruptObject, pack_header, read_header


class DiskTier:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def open(self) -> DiskTier:
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.kvc"):  # a previous run's objects are not ours
            stale.unlink()
        return self

    def _path(self, disk_version: int) -> Path:
        return self.directory / f"{disk_version}.kvc"

    def demote(self, segment: memoryview, offset: int, alloc_bytes: int, version: int,
               disk_version: int) -> None:
        """Copy the object `version` at `offset` to a file. Raises CorruptObject if the range
        holds anything else (so a wrong copy is never made)."""
        data = segment[offset:offset + alloc_bytes]
        checksum, head_version, size = read_header(data)
        if head_version != version or size != alloc_bytes - HEADER_BYTES:
            raise CorruptObject(f"demote: range at {offset} holds version {head_version}, "
                                f"not {version}")
        tmp = self._path(disk_version).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(pack_header(checksum, disk_version, size))
            f.write(data[HEADER_BYTES:])
        os.replace(tmp, self._path(disk_version))

    def promote(self, segment: memoryview, offset: int, alloc_bytes: int, version: int,
                disk_version: int) -> None:
        """Copy file `disk_version` into the segment at `offset`, as object `version`."""
        path = self._path(disk_version)
        if path.stat().st_size != alloc_bytes:
            raise CorruptObject(f"promote: {path.name} is {path.stat().st_size} bytes, "
                                f"expected {alloc_bytes}")
        target = segment[offset:offset + alloc_bytes]
        with open(path, "rb") as f:
            f.readinto(target)
        checksum, head_version, size = read_header(target)
        if head_version != disk_version:
            raise CorruptObject(f"promote: {path.name} holds version {head_version}")
        target[:HEADER_BYTES] = pack_header(checksum, version, size)

    def drop(self, disk_version: int) -> None:
        self._path(disk_version).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("*.kvc"))

"""prefault.py: a node's segment made resident at start (`NodeConfig.prefault`), its bytes
unchanged, by madvise or by touching each page; bad input refused."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from kvcake.store import prefault
from kvcake.store.config import NodeConfig
from kvcake.store.master import MasterService
from kvcake.store.node import StoreNode
from kvcake.transfer.segment import SharedBlock

SIZE = 64 * mmap.PAGESIZE


def _resident_kib(name: str) -> int:
    """Rss of this process's mapping of the shared-memory block `name` (smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(name):
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping of {name} in /proc/self/smaps")


@pytest.fixture
def block():  # type: ignore[no-untyped-def]
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs /proc/self/smaps (Linux) to see which pages are resident")
    shared = SharedBlock(SIZE)
    yield shared
    shared.mapping.close()
    shared.unlink()


@pytest.mark.parametrize("populate", [True, False], ids=["madvise", "touch"])
def test_fault_in_makes_every_page_resident_and_changes_no_byte(
        block: SharedBlock, populate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not populate:
        monkeypatch.setattr(prefault, "_populate", lambda view: False)
    with memoryview(block.mapping) as view:
        view[5 * mmap.PAGESIZE + 3] = 0xAB  # one page already written, with a byte to keep
        assert _resident_kib(block.name) * 1024 < SIZE
        how = prefault.fault_in(view)
        assert how in (("madvise", "touch") if populate else ("touch",))
        assert _resident_kib(block.name) * 1024 == SIZE
        assert view[5 * mmap.PAGESIZE + 3] == 0xAB and view.tobytes().count(0) == SIZE - 1


def test_fault_in_refuses_read_only_memory() -> None:
    with pytest.raises(ValueError, match="writable"):
        prefault.fault_in(memoryview(bytes(16)))


@pytest.mark.parametrize("on", [True, False])
def test_a_node_faults_its_segment_in_before_registering_only_when_asked(
        on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    service = MasterService()
    seen: list[tuple[int, int]] = []  # (segment bytes, nodes registered at that moment)

    def spy(view: memoryview) -> str:
        seen.append((len(view), len(service.index.nodes)))
        return "touch"

    monkeypatch.setattr("kvcake.store.node.fault_in", spy)
    node = StoreNode(NodeConfig(1 << 20, prefault=on), service, node_id="n").start()
    try:
        assert seen == ([(1 << 20, 0)] if on else [])
        assert "n" in service.index.nodes
    finally:
        node.close()

"""Buffers that a restore or a save's arena fills are marked for transparent huge pages."""

from __future__ import annotations

from pathlib import Path

import torch

from coci_core import CheckpointManager
from coci_core.engine.hugepages import HUGE_PAGE_BYTES, empty_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _aligned_inside(t: torch.Tensor) -> int:
    return -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


def test_a_large_buffer_is_marked_for_huge_pages_and_is_an_ordinary_tensor() -> None:
    """``hg`` (MADV_HUGEPAGE) on the buffer's mapping where the kernel has THP; the buffer
    is torch's own (resizable, shareable), its bytes as written."""
    out = empty_bytes(16 << 20)
    assert out.dtype == torch.uint8 and out.numel() == 16 << 20
    flags = _vm_flags(_aligned_inside(out))
    assert ("hg" in flags) == THP.exists(), flags
    out.fill_(3)
    assert int(out[-1]) == 3 and out.untyped_storage().resizable()


def test_a_restored_large_array_lies_in_huge_pages(tmp_path: Path) -> None:
    """A restore's new arrays of 4 MiB and more (each faulted in once as it is read: 65,536
    faults per 256 MB in 4 KiB pages) are read into memory marked for huge pages."""
    w = torch.randn(3 << 20)  # 12 MiB
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": w}).wait()
        arena = mgr._snapshotter._arena
        restored = mgr.restore()["w"]
    assert torch.equal(restored, w)
    assert ("hg" in _vm_flags(_aligned_inside(restored))) == THP.exists()
    assert arena is not None
    assert ("hg" in _vm_flags(_aligned_inside(arena.bytes))) == THP.exists()

"""The block=False copy runs on the writer thread without torch ops: exact for every dtype and
layout, and no OpenMP team of its own (which slowed every training step while it lived)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.format.tree import ArrayLeaf
from coci_core.engine.save.partition import Share
from coci_core.engine.save.snapshot import LeafSlot, copy_outside_torch, plan_layout

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.bool, torch.float8_e4m3fn, torch.uint16, torch.uint32, torch.uint64,
]  # fmt: skip


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    bits = torch.randint(
        0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8
    )
    return bits.view(dtype).reshape(shape) if shape else bits.view(dtype).reshape(())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _copied(src: torch.Tensor, slot: LeafSlot) -> torch.Tensor:
    dst = torch.empty(slot.shape, dtype=slot.dtype)
    copy_outside_torch(dst, src, slot)
    return dst


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_leaves_of_every_dtype_and_layout_are_copied_bit_exact(dtype: torch.dtype) -> None:
    base = _tensor(dtype, (6, 10))
    for src in (base, base.t(), base[::2, 1:7], base[3, 4], base[:0]):
        slot = LeafSlot(0, src.numel() * src.element_size(), src.dtype, tuple(src.shape))
        got = _copied(src, slot)
        assert got.shape == src.shape
        assert torch.equal(_bytes(got), _bytes(src))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128], ids=str)
def test_a_region_of_a_leaf_is_the_same_bytes_as_the_flat_tensor(dtype: torch.dtype) -> None:
    """Sharded saves copy byte ranges of a leaf (also of a non-contiguous one)."""
    base = _tensor(dtype, (8, 12)).t()
    item = base.element_size()
    flat = base.reshape(-1)
    slots, _ = plan_layout((_leaf(base),), (Share(0, 5 * item, 45 * item),))
    got = _copied(base, slots[0])
    assert torch.equal(_bytes(got), _bytes(flat[5:45]))


def _leaf(t: torch.Tensor) -> ArrayLeaf:
    return ArrayLeaf(key="x", tensor=t, kind="tensor")


def test_lazily_conjugated_and_negated_tensors_fall_back_exactly() -> None:
    z = torch.randn(4, 5, dtype=torch.complex64)
    for src in (z.conj(), torch._neg_view(z)):
        slot = LeafSlot(0, src.numel() * 8, src.dtype, tuple(src.shape))
        assert torch.equal(_copied(src, slot), src.resolve_conj().resolve_neg())


def _os_threads() -> set[str]:
    """The ids of this process's OS threads (another test's thread may end meanwhile: only
    the new ones count)."""
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_block_false_save_starts_no_openmp_team_on_the_writer(tmp_path: Path) -> None:
    """A torch op on the long-lived writer thread would give it OpenMP workers of its own;
    the writer's copy adds only the writer itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        state = {"w": torch.randn(1 << 20), "b": torch.randn(64, 64).t()}
        (state["w"] * 2).sum()  # the training thread's own team exists before we count
        mgr = CheckpointManager(tmp_path, compression="none")
        try:
            before = _os_threads()
            mgr.save(1, state, block=False)
            mgr.wait()
            assert len(_os_threads() - before) == 1  # the writer, nothing else
            restored = mgr.restore()
        finally:
            mgr.close()
        assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
    finally:
        torch.set_num_threads(threads)

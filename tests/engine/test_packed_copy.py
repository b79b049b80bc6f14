"""Small whole leaves lie end to end in the arena and, from the second save of the same tensors
on, are copied by a few ``torch.cat`` calls over byte views made once: each save still holds
the values of its own save() call, whatever the dtypes, views and moves of the tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.directory.steps import read_manifest
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.format.tree import ArrayLeaf
from coci_core.engine.save.snapshot import ALIGN_BYTES, plan_layout
from coci_core.errors import CorruptCheckpointError
from coci_core.knobs import PACKED_COPY_BYTES
from coci_core.storage import LocalStorage
from tests.harness.states import assert_same


def _leaf(t: torch.Tensor, key: str = "/t") -> ArrayLeaf:
    return ArrayLeaf(key, t, "tensor")


def test_small_leaves_lie_end_to_end_first_each_on_a_multiple_of_its_element_size() -> None:
    big = PACKED_COPY_BYTES // 4 + 1  # one element over the packed size
    tensors = [
        torch.zeros(3),  # 12 bytes
        torch.zeros(3, dtype=torch.bfloat16),  # 6 bytes
        torch.zeros(5, dtype=torch.int8),
        torch.zeros((), dtype=torch.float64),
        torch.zeros(1, dtype=torch.complex128),
        torch.zeros(7, dtype=torch.bool),
        torch.zeros(big),  # larger than PACKED_COPY_BYTES: after the small ones
        torch.zeros(2),
    ]
    slots, total = plan_layout(tuple(_leaf(t) for t in tensors))
    assert [s.leaf for s in slots] == list(range(8))  # in the leaves' order
    # by element size from the largest, each kind in the leaves' order: no gap
    by_offset = sorted(range(8), key=lambda i: slots[i].offset)
    assert by_offset == [4, 3, 0, 7, 1, 2, 5, 6]
    assert [slots[i].offset for i in by_offset[:7]] == [0, 16, 24, 36, 44, 50, 55]
    assert slots[6].offset == 64 and slots[6].offset % ALIGN_BYTES == 0
    assert total % 4096 == 0 and total >= 64 + big * 4
    for slot, t in zip(slots, tensors, strict=True):
        assert slot.offset % t.element_size() == 0


def _mixed_state(gen: torch.Generator) -> dict[str, Any]:
    """Small tensors of many dtypes and views, and a large one between them."""
    grid = torch.randn(6, 5, generator=gen)
    complex_ = torch.randn(4, dtype=torch.complex64, generator=gen)
    return {
        "f32": torch.randn(33, generator=gen),
        "bf16_odd": torch.randn(7, generator=gen).to(torch.bfloat16),
        "i8": torch.randint(-100, 100, (9,), dtype=torch.int8, generator=gen),
        "i64": torch.randint(0, 1 << 40, (3,), generator=gen),
        "scalar": torch.tensor(3.5),
        "flags": torch.rand(11, generator=gen) > 0.5,
        "c64": complex_,
        "f64": torch.randn(2, 3, dtype=torch.float64, generator=gen),
        "large": torch.randn(PACKED_COPY_BYTES // 4 + 100, generator=gen),
        "transposed": grid.t(),  # not contiguous: copied one by one
        "empty": torch.zeros(0),
        "after_large": torch.randn(5, generator=gen),
    }


def _changed_in_place(state: dict[str, Any], step: int) -> None:
    for t in state.values():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.numel():
            t.add_(step + 1)


def test_every_save_holds_its_own_values_once_the_copy_is_packed(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = _mixed_state(gen)
    expected = []
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(5):
            _changed_in_place(state, step)
            mgr.save(step, state).wait()
            expected.append({k: v.clone() for k, v in state.items()})
            if step >= 1:  # the same tensors twice in a row: the copy goes by runs
                runs = mgr._snapshotter._runs
                # the small tensors at once, but for a break at the transposed view among them
                assert runs is not None and len(runs.runs) <= 2
                rest = {mgr._snapshotter._slots[i].leaf for i in runs.rest}
                assert rest == {8, 9}  # the large tensor and the transposed view
        for step, want in enumerate(expected):
            assert_same(mgr.restore(step=step), want)


def test_a_tensor_given_new_memory_is_copied_from_its_new_memory(tmp_path: Path) -> None:
    """``p.data = ...`` between saves (the same dtype and shape, new memory): the byte views of
    the old memory are not used; the save holds the new values."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    expected = []
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(6):
            if step in (3, 4):
                for p in model.parameters():
                    p.data = torch.full_like(p, float(step))  # new memory, old one still alive
            else:
                for p in model.parameters():
                    p.data.add_(1.0)
            state = {"model": model.state_dict()}
            mgr.save(step, state).wait()
            expected.append({"model": {k: v.clone() for k, v in model.state_dict().items()}})
        for step, want in enumerate(expected):
            got = mgr.restore(step=step)
            assert_same(dict(got["model"]), want["model"])


def test_lazy_conjugate_and_negative_views_are_saved_as_they_read(tmp_path: Path) -> None:
    c = torch.randn(5, dtype=torch.complex64)
    f = torch.randn(5)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(3):
            c.mul_(1j)
            state = {"conj": c.conj(), "neg": torch._neg_view(f), "plain": f}
            mgr.save(step, state).wait()
            got = mgr.restore(step=step)
            assert torch.equal(got["conj"], c.conj().resolve_conj())
            assert torch.equal(got["neg"], -f)


def test_a_tensor_becoming_a_lazy_view_of_the_same_bytes_is_saved_as_it_reads(
    tmp_path: Path,
) -> None:
    """``c``, then ``c.conj()`` or a negative view: the same address, dtype, shape and strides,
    other values; the copy made from ``c``'s bytes must not be reused. Nor may a conjugate
    view share the leaf of the tensor it views."""
    c = torch.randn(6, dtype=torch.complex64)
    f = torch.randn(6)
    states = [
        {"z": c, "f": f},
        {"z": c, "f": f},
        {"z": c.conj(), "f": torch._neg_view(f)},
        {"z": c, "f": f, "z_conj": c.conj()},
    ]
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step, state in enumerate(states):
            mgr.save(step, state).wait()
        got = mgr.restore(step=2)
        assert torch.equal(got["z"], c.conj().resolve_conj())
        assert torch.equal(got["f"], -f)
        got = mgr.restore(step=3)
        assert torch.equal(got["z"], c) and torch.equal(got["z_conj"], c.conj().resolve_conj())


@pytest.mark.parametrize("where", ["last byte", "first byte"])
def test_damage_to_a_packed_tensor_names_that_tensor_only(tmp_path: Path, where: str) -> None:
    """Neighbours in the data file share no bytes: a flipped byte at either edge of one
    tensor's bytes is caught by that tensor's checksum alone."""
    state = {f"t{i:02d}": torch.randn(3 + i) for i in range(20)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
        mgr.save(2, state).wait()
    storage = LocalStorage(tmp_path)
    entries = {e.key: e for e in read_manifest(storage, 2).tensors}
    (piece,) = entries["/t07"].pieces
    (before,) = entries["/t06"].pieces
    assert before.offset + before.nbytes == piece.offset  # end to end
    path = tmp_path / step_dir_name(2) / piece.file
    data = bytearray(path.read_bytes())
    data[piece.offset + (piece.nbytes - 1 if where == "last byte" else 0)] ^= 0x01
    path.write_bytes(bytes(data))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError) as info:
        mgr.restore(step=2)
    assert info.value.bad == ["/t07"]

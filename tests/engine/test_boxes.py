"""An array stored as boxes (manifest format 4, what the ranks of a 2-D mesh write), in one
process: restored whole and in place into a module's own tensor; damaged boxes found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, CorruptCheckpointError
from coci_core.engine.restore.restore import verify_checkpoint
from coci_core.storage import LocalStorage
from tests.adversarial.craft import edit_manifest

W = torch.arange(30, dtype=torch.float32).reshape(6, 5)
BOXES = [[[0, 0], [3, 3]], [[0, 3], [3, 2]], [[3, 0], [3, 3]], [[3, 3], [3, 2]]]


def _saved(root: Path, boxes: list[Any] = BOXES, version: int = 4) -> None:
    stored = torch.cat([W[a : a + m, b : b + n].reshape(-1) for (a, b), (m, n) in BOXES])
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": {"w": stored}, "epoch": 3}).wait()

    def as_boxes(doc: dict[str, Any]) -> None:
        (entry,) = doc["tensors"]
        entry["shape"] = [6, 5]
        entry["boxes"] = boxes
        doc["format_version"] = version
        doc["world_size"] = 4

    edit_manifest(root, 1, as_boxes)


def test_restored_whole_and_in_place(tmp_path: Path) -> None:
    _saved(tmp_path)
    with CheckpointManager(tmp_path) as mgr:
        assert torch.equal(mgr.restore()["model"]["w"], W)
        assert mgr.manifest(1).format_version == 4
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(torch.zeros(6, 5))
        live = module.w
        state = mgr.restore(into={"model": module})
        assert state["model"]["w"].data_ptr() == live.data_ptr()  # read into its own memory
        assert torch.equal(module.w.detach(), W)
        assert mgr.last_restore.bytes_read == W.numel() * 4


def test_overlapping_boxes_are_damage(tmp_path: Path) -> None:
    # as many elements as the array, one overlap and so one gap: found where they are read
    overlap = [[[0, 0], [3, 3]], [[0, 2], [3, 3]], [[3, 0], [3, 3]], [[3, 3], [3, 1]]]
    _saved(tmp_path, overlap)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError, match="overlap"):
        mgr.restore(strict=True)
    assert verify_checkpoint(LocalStorage(tmp_path), 1) == ["/model/w"]


@pytest.mark.parametrize(
    ("boxes", "version", "match"),
    [
        (BOXES, 3, "not a field of format 3"),
        ([BOXES[1], BOXES[0], *BOXES[2:]], 4, "not after the box before it"),
        (BOXES[:3], 4, "hold 24 elements, the array 30"),
        ([[[0, 0], [3, 4]], *BOXES[1:]], 4, "hold 33 elements"),
        ([[[0, 3], [3, 3]], *BOXES[1:]], 4, "outside shape"),
        ([[[0, 0], [0, 3]], *BOXES[1:]], 4, "must be an integer in \\[1,"),
        ([*BOXES, [[5, 4], [1, 1]]], 4, "1 to 4 boxes"),
    ],
)
def test_malformed_boxes_are_refused_naming_the_field(
    tmp_path: Path, boxes: list[Any], version: int, match: str
) -> None:
    _saved(tmp_path, boxes, version)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError, match=match):
        mgr.restore(strict=True)

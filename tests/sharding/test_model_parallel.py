"""DTensors of any placement (FSDP2, tensor parallelism, 2-D meshes): each rank writes only the
bytes it holds, a replicated part once; restore onto another mesh reads only what each rank
needs. Real processes, gloo."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.commands import cli
from coci_core.engine.format.manifest import BOXES_FORMAT_VERSION
from tests.sharding._dist_child import launch
from tests.sharding._mesh_child import SAVE_STEP, full_state

MODULE = "tests.sharding._mesh_child"


def _ok(results: list[tuple[int, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    assert all(code == 0 and r is not None for code, r in results), results
    return sorted((r for _, r in results if r is not None), key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("mesh") / "ckpt"
    return directory, _ok(launch(4, {"mode": "save", "dir": str(directory)}, module=MODULE))


def test_each_byte_is_written_once_by_a_rank_that_holds_it(
    saved_2x2: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = saved_2x2
    manifest = CheckpointManager(directory).manifest(SAVE_STEP)
    assert manifest.format_version == BOXES_FORMAT_VERSION  # Shard(1) parts are boxes
    entries = {e.key.removeprefix("/model/"): e for e in manifest.tensors}
    full = full_state()
    for key, tensor in full.items():
        entry = entries[key]
        assert entry.shape == tuple(tensor.shape)
        # the pieces tile the stored bytes: every byte written once
        assert sum(p.length for p in entry.pieces) == tensor.numel() * tensor.element_size()
    assert entries["s0s1"].boxes is not None and len(entries["s0s1"].boxes) == 4
    # each rank's part cut in pieces of at most 32 bytes (the size the save was given)
    assert len(entries["s0s1"].pieces) > 4
    assert max(p.length for p in entries["s0s1"].pieces) <= 32
    assert entries["strided"].boxes is None  # whole rows: stored as the tensor's own bytes
    assert entries["s0rep"].boxes is None
    for r, result in enumerate(results):
        written: dict[str, int] = {}
        for key, entry in entries.items():
            written[key] = sum(p.length for p in entry.pieces if p.file == f"data-r{r}.bin")
        for key, held in result["held"].items():
            assert written[key] <= held, (r, key)
        # a part held by two ranks is split between them
        assert written["s0rep"] < result["held"]["s0rep"]


@pytest.mark.parametrize(
    ("world", "layouts"),
    [
        (4, [[[4, 1], ["S0", "R"]], [[1, 4], ["R", "S1"]], [[2, 2], ["S1", "S0"]]]),
        (2, [[[2], ["S1"]], [[2], ["S0"]]]),
    ],
    ids=["4x1,1x4,2x2", "2"],
)
def test_restore_onto_another_mesh_reads_each_ranks_part_in_place(
    saved_2x2: tuple[Path, list[dict[str, Any]]], world: int, layouts: list[Any]
) -> None:
    directory, _ = saved_2x2
    cfg = {"mode": "restore", "dir": str(directory), "layouts": layouts}
    results = _ok(launch(world, cfg, module=MODULE))
    total = CheckpointManager(directory).manifest(SAVE_STEP).nbytes
    for rank in results:
        assert len(rank["layouts"]) == len(layouts)
        for r in rank["layouts"]:
            assert all(r["in_place"].values()), r
            assert all(r["equal"].values()), r
            assert r["plain"]
            assert r["bytes_read"] < total  # only the pieces that hold its part


def test_restore_in_one_process_is_whole(saved_2x2: tuple[Path, list[dict[str, Any]]]) -> None:
    directory, _ = saved_2x2
    state = CheckpointManager(directory).restore()
    for key, tensor in full_state().items():
        assert torch.equal(state["model"][key], tensor), key
    assert state["step"] == SAVE_STEP


def test_export_to_dcp_loads_with_dcp_onto_another_mesh(
    saved_2x2: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    directory, _ = saved_2x2
    out = tmp_path / "dcp"
    assert cli.main(["export", str(directory), str(out), "--format", "dcp"]) == 0
    cfg = {"mode": "dcp_load", "dir": str(out), "mesh": [2], "placements": ["S1"]}
    for r in _ok(launch(2, cfg, module=MODULE)):
        assert all(r["equal"].values()), r
        assert r["plain"]


def test_import_of_a_sharded_dcp_checkpoint_restores_onto_another_mesh(tmp_path: Path) -> None:
    dcp_dir = tmp_path / "dcp"
    _ok(launch(4, {"mode": "dcp_save", "dir": str(dcp_dir)}, module=MODULE))
    assert len(list(dcp_dir.glob("*.distcp"))) == 4  # written by four ranks
    imported = tmp_path / "coci"
    assert cli.main(["import", str(dcp_dir), str(imported)]) == 0
    cfg = {"mode": "restore", "dir": str(imported), "mesh": [2], "placements": ["S0"]}
    for r in _ok(launch(2, cfg, module=MODULE)):
        assert all(r["in_place"].values()) and all(r["equal"].values()), r
        assert r["plain"]


def test_a_rank_killed_during_a_sharded_save_publishes_nothing(tmp_path: Path) -> None:
    """Rank 3 of the 2x2 mesh is SIGKILLed half-way through its part of the second save:
    nothing of that save is published, the first stays intact, the others get an error
    naming rank 3."""
    cfg = {"mode": "save", "dir": str(tmp_path), "pause_rank": 3}
    results = launch(4, cfg, module=MODULE, kill_rank=3)
    assert results[3] == (-signal.SIGKILL, None)
    survivors = [r for code, r in results[:3] if code == 0 and r is not None]
    assert len(survivors) == 3
    assert all("[3]" in r["save_error"] for r in survivors), survivors
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [SAVE_STEP]
        assert mgr.verify() == {SAVE_STEP: []}

"""CheckpointManager(dir) inside an initialized torch.distributed job uses its process group
by default (each rank writes its share), fails clearly when only one rank makes a manager,
and opting out per process on one directory is refused for the second writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from tests.sharding._dist_child import launch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

_MODULE = "tests.sharding._default_group_child"


def test_every_rank_writes_its_share_by_default(tmp_path: Path) -> None:
    """Before: every rank wrote the whole state into the same directory (2x the bytes, two
    processes racing on one step directory)."""
    results = launch(2, {"dir": str(tmp_path), "mode": "every"}, module=_MODULE)
    assert [code for code, _ in results] == [0, 0], results
    outs = [r for _, r in results]
    assert all(o is not None and "error" not in o for o in outs), outs
    assert [o["world_size"] for o in outs if o] == [2, 2]
    assert all(o and o["restored"] for o in outs)
    with CheckpointManager(tmp_path) as mgr:
        manifest = mgr.manifest(4)
        assert manifest.world_size == 2
        assert sorted(f.name for f in manifest.files) == ["data-r0.bin", "data-r1.bin"]
        assert sum(f.nbytes for f in manifest.files) < 2 * 400_000  # written once, not twice


def test_a_manager_on_one_rank_only_fails_clearly(tmp_path: Path) -> None:
    results = launch(2, {"dir": str(tmp_path), "mode": "alone"}, module=_MODULE)
    assert [code for code, _ in results] == [0, 0], results
    rank0 = results[0][1]
    assert rank0 is not None
    assert "ConfigError" in rank0["error"]
    assert "rank(s) [1] made no CheckpointManager" in rank0["error"]
    assert "RankGroup.single()" in rank0["error"]


def test_opting_out_on_one_directory_refuses_the_second_writer(tmp_path: Path) -> None:
    results = launch(2, {"dir": str(tmp_path), "mode": "single"}, module=_MODULE)
    assert [code for code, _ in results] == [0, 0], results
    rank0, rank1 = (r for _, r in results)
    assert rank0 is not None and "error" not in rank0
    assert rank1 is not None and "DirectoryInUseError" in rank1["error"]
    assert "another coci writer (process" in rank1["error"]
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [4]


def test_a_job_refused_a_busy_directory_fails_on_every_rank_at_once(tmp_path: Path) -> None:
    """A second 2-rank job started on a directory another job writes to: rank 0 is refused
    the lease at its first save, and rank 1, whose save went on, raises the same reason as
    soon as it waits for that save (before: it waited for rank 0's commit for twice the
    group's timeout, 1200 s by default, and then blamed a silent rank 0)."""
    with CheckpointManager(tmp_path) as other_job:
        other_job.save(1, {"w": torch.ones(3)}).wait()
        results = launch(2, {"dir": str(tmp_path), "mode": "every"}, module=_MODULE, timeout_s=120)
        assert other_job.steps() == [1]
    assert [code for code, _ in results] == [0, 0], results
    errors = [r["error"] if r else "" for _, r in results]
    assert errors[0].startswith("DirectoryInUseError"), errors
    assert "DirectoryInUseError: another coci writer" in errors[1], errors
    assert "did not commit within" not in errors[1]

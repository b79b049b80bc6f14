"""CociCheckpoint under strategy="ddp" with 2 CPU processes (gloo): kill, resume, exactness."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from tests.harness.faults import flip_stored_byte
from tests.harness.processes import Child, module, run
from tests.harness.results import result_rows

pytestmark = [pytest.mark.dist, pytest.mark.slow]

_CHILD = "tests.lightning._ddp_child"
PER_RANK_BATCH = 8
SAMPLES_PER_RANK = 128  # 256 samples over 2 ranks


def _results(stdout: str) -> dict[int, dict[str, Any]]:
    return {row["rank"]: row for row in result_rows(stdout)}


def _run(directory: Path, total: int) -> dict[int, dict[str, Any]]:
    out = run(module(_CHILD, str(directory), str(total)), timeout_s=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = _results(out.stdout)
    assert sorted(results) == [0, 1]
    return results


def test_ddp_killed_mid_epoch_resumes_bit_exact_on_one_step_past_one_ranks_damage(
    tmp_path: Path,
) -> None:
    """Both ranks killed with SIGKILL at step 17 (a node failure), then rank 1's random states
    of the newest step damaged on disk; a new 2-process run (``ckpt_path="last"``) resumes both
    ranks from the step before (the newest intact for both) and ends bit-identical to an
    uninterrupted run, each rank training on each of its remaining samples exactly once."""
    expected = _run(tmp_path / "uninterrupted", 30)
    assert expected[0]["digest"] == expected[1]["digest"]

    with Child(
        module(_CHILD, str(tmp_path / "run"), "30", "17"),
        stderr=subprocess.DEVNULL,
        kill_scope="group",
    ) as child:
        child.kill_at("AT 17")
    steps = CheckpointManager(tmp_path / "run" / "coci", keep_last=None).steps()
    # the persist of step 15 may not have been durable yet when the kill came
    assert steps in ([5, 10], [5, 10, 15])
    manifest = CheckpointManager(tmp_path / "run" / "coci").manifest(steps[-1])
    # both ranks wrote their share, and each its own random states
    assert manifest.world_size == 2
    assert [f.name for f in manifest.files] == ["data-r0.bin", "data-r1.bin"]
    assert all(r.tree for r in manifest.per_rank) and len(manifest.per_rank) == 2
    flip_stored_byte(tmp_path / "run" / "coci", steps[-1], 1, own=True)
    restored = steps[-2]
    resumed = _run(tmp_path / "run", 30)
    epoch_steps = SAMPLES_PER_RANK // PER_RANK_BATCH
    for rank in (0, 1):
        assert resumed[rank]["digest"] == expected[rank]["digest"]
        assert resumed[rank]["seen"] == expected[rank]["seen"][restored * PER_RANK_BATCH :]
        # the restored step is inside the first epoch (16 steps): its samples, once each
        first_epoch = (
            expected[rank]["seen"][: restored * PER_RANK_BATCH]
            + resumed[rank]["seen"][: (epoch_steps - restored) * PER_RANK_BATCH]
        )
        assert len(first_epoch) == SAMPLES_PER_RANK
        assert len(set(first_epoch)) == SAMPLES_PER_RANK

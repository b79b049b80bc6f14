"""SIGKILL at every file-system operation of a re-save and of retention: a committed step is
never lost, and never left as a manifest without its data."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from tests.harness.processes import module, run

pytestmark = pytest.mark.faults


def _run(directory: Path, kill_at: int, exchange: bool) -> subprocess.CompletedProcess[str]:
    return run(
        module("tests.adversarial._kill_child", str(directory), str(kill_at), str(int(exchange)))
    )


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "two-renames"])
def test_kill_at_every_point_of_resave_and_retention(tmp_path: Path, exchange: bool) -> None:
    dry = _run(tmp_path / "dry", -1, exchange)
    assert dry.returncode == 0, dry.stderr
    ops = int(dry.stdout.split("OPS", 1)[1])
    assert ops >= 8  # the fsyncs, renames and deletions really were counted
    tags = {1.0, 2.0, 3.0}
    aside = 0  # kills that left step 5 renamed aside, between the two renames
    for kill_at in range(ops):
        directory = tmp_path / f"k{kill_at}"
        proc = _run(directory, kill_at, exchange)
        assert proc.returncode == -9, (kill_at, proc.stderr[-2000:])
        names = [p.name for p in directory.iterdir()]
        if "step-0000000005" not in names and "step-0000000006" not in names:
            aside += any(".coci-old-" in n for n in names)
        with CheckpointManager(directory, keep_last=None) as mgr:
            steps = mgr.steps()
            assert steps, f"kill at operation {kill_at} lost every committed step"
            assert set(steps) <= {5, 6}
            for step in steps:
                assert mgr.verify(step) == {step: []}, (kill_at, step)
                restored = mgr.restore(step=step)
                tag = restored["tag"]
                assert tag in tags
                assert (step == 6) == (tag == 3.0)
                assert torch.equal(restored["w"], torch.full((50_000,), tag))
                assert torch.equal(restored["b"], torch.arange(1000) * tag)
    # The two-rename publish really was killed in its gap (and recovered); the swap has none.
    assert aside == (0 if exchange else 1)

"""The core rule of a fixed interval, in a plain training loop: a
``Checkpointer(policy="every_n_steps", every_n_steps=16)`` saves at exactly the multiples of 16,
across epoch ends and across a SIGKILL of the training process and a resume."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from coci_core import CheckpointManager
from tests.harness.processes import Child, module
from tests.training._interval_child import train


def test_a_plain_loop_saves_at_the_multiples_across_epochs_and_a_kill(tmp_path: Path) -> None:
    """Two epochs of 64 steps: saves at 16, 32, ..., 128. Killed (SIGKILL) after step 40, the
    resumed loop continues from 32 and saves at 48, 64 (the epoch's end), ... 128, each
    holding its own step, and ends with the weights of the uninterrupted loop."""
    reference = train(str(tmp_path / "ref"), 128)
    expected = list(range(16, 129, 16))
    assert CheckpointManager(tmp_path / "ref", keep_last=None).steps() == expected

    command = module("tests.training._interval_child", str(tmp_path / "run"), "128", "40")
    with Child(command, stderr=subprocess.DEVNULL) as child:
        for line in child.lines():
            if line.startswith("AT 40"):
                child.kill()
        assert child.wait() == -signal.SIGKILL
    assert CheckpointManager(tmp_path / "run", keep_last=None).steps() == [16, 32]
    resumed = train(str(tmp_path / "run"), 128)
    assert resumed["start"] == 32
    assert resumed["digest"] == reference["digest"]
    with CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        assert mgr.steps() == expected
        assert [mgr.restore(s)["step"] for s in expected] == expected

"""An Accelerate loop (CociCheckpointer's default ``preemption="auto"``) gets a real SIGTERM:
``ckpt.step()`` saves the next step and raises ``Preempted``, the process exits 143, and the
restarted job resumes from that step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from coci_core import CheckpointManager
from tests.harness.processes import Child, module, run

CHILD = "tests.preemption._accelerate_child"


def test_accelerate_stops_on_sigterm_and_resumes(tmp_path: Path) -> None:
    with Child(module(CHILD, str(tmp_path), "notice"), stderr=subprocess.DEVNULL) as child:
        lines = []
        while line := child.readline():
            lines.append(line)
            if line.startswith("READY"):
                os.kill(child.pid, signal.SIGTERM)
                break
        code = child.wait(30)  # Kubernetes' default grace period
        lines.extend(child.lines())
    assert code == 143
    (stop,) = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("PREEMPTED")]
    assert stop["code"] == 143 and stop["saved"] > 3
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.latest_step() == stop["saved"]
    done = run(module(CHILD, str(tmp_path), "resume", str(stop["saved"] + 2)))
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = [json.loads(x[7:]) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert result["start"] == stop["saved"]

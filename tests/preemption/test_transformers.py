"""The Trainer adapter (CociCallback, default ``preemption="auto"``) gets a real SIGTERM from
outside: it saves the next step, the process exits 143, and the restarted run resumes from
that step, bit-identical to a run never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from coci_core import CheckpointManager
from tests.harness.processes import Child, child_env, module, run

CHILD = "tests.transformers.run"


def test_trainer_stops_on_sigterm_and_resumes(tmp_path: Path) -> None:
    env = child_env({"OMP_NUM_THREADS": "1"})
    # saves every 3 steps (save_steps); after step 4 the child waits for its stdin to close
    command = module(CHILD, str(tmp_path / "run"), "12", "4")
    with Child(command, env=env, stderr=subprocess.DEVNULL) as child:
        lines = []
        while line := child.readline():
            lines.append(line)
            if line.startswith("AT 4"):
                os.kill(child.pid, signal.SIGTERM)
                assert child.proc.stdin is not None
                child.proc.stdin.close()  # after the signal: the handler ran before it goes on
                break
        lines.extend(child.lines())
        code = child.wait(60)
    assert code == 143
    assert [x.split()[1] for x in lines if x.startswith("AT ")] == ["1", "2", "3", "4", "5"]
    assert not any(x.startswith("RESULT ") for x in lines)  # nothing after train() ran
    with CheckpointManager(tmp_path / "run" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 5]  # the planned save, and the notice's at the next step
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["coci"]
    command = [str(tmp_path / "run"), "12", "--resume", "--reference", str(tmp_path / "ref")]
    done = run(module(CHILD, *command), env=env, timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        x.split(" ", 1)[0]: json.loads(x.split(" ", 1)[1])
        for x in done.stdout.splitlines()
        if x.startswith(("RESULT ", "REFERENCE "))
    }
    assert rows["RESULT"]["start"] == 5
    assert rows["RESULT"]["digest"] == rows["REFERENCE"]["digest"]

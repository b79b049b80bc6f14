"""A SIGTERM sent to every process of the job (SLURM, a service stopped, ``kill -TERM
-<pgid>``) reaches the data loader's workers too: shielded (each adapter shields its loaders;
a plain loop calls ``Checkpointer.shield_loader_workers``), they leave it to the training
process, which saves the next step and exits with the notice's status 143 within the grace
period. Before, the workers died and the next batch raised ``DataLoader worker (pid N) is
killed by signal: Terminated``: nothing saved, and Accelerate's process hung until SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from tests.harness.processes import Child, module

pytestmark = [pytest.mark.faults]

GRACE_S = 30.0


def _sigterm_to_the_job(cfg: dict[str, Any]) -> tuple[int, list[str]]:
    """Run the child in a process group of its own; once its two workers run, SIGTERM the
    whole group; SIGKILL it ``GRACE_S`` later (the end of the grace period). Its status and
    its lines."""
    command = module("tests.preemption._workers_child", json.dumps(cfg))
    with Child(command, kill_scope="group") as child:
        lines = []
        while line := child.readline():
            lines.append(line)
            if line.startswith("WORKERS"):
                assert len(json.loads(line.split(" ", 1)[1])) == 2, line
                os.killpg(child.pid, signal.SIGTERM)
                break
        try:
            code = child.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.wait()
        lines.extend(child.lines())
    return code, lines


@pytest.mark.parametrize(
    ("kind", "context"),
    [
        ("loop", None),
        ("loop", "spawn"),
        ("lightning", None),
        ("accelerate", None),
        ("transformers", None),
    ],
)
def test_a_job_wide_sigterm_saves_the_next_step_and_exits_143(
    tmp_path: Path, kind: str, context: str | None
) -> None:
    cfg = {"dir": str(tmp_path), "kind": kind, "shield": True, "context": context}
    code, lines = _sigterm_to_the_job(cfg)
    assert code == 143, lines
    directory = tmp_path / "coci" if kind == "transformers" else tmp_path
    with CheckpointManager(directory) as reader:
        (step,) = reader.steps()
        assert step >= 4


def test_without_the_shield_the_workers_die_and_nothing_is_saved(tmp_path: Path) -> None:
    """What the shield is for (PyTorch's own handling in a worker)."""
    code, lines = _sigterm_to_the_job(
        {"dir": str(tmp_path), "kind": "loop", "shield": False, "context": None}
    )
    assert code not in (0, 143), lines
    with CheckpointManager(tmp_path) as reader:
        assert reader.steps() == []

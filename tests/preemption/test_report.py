"""``coci report`` shows a preemption notice: its step, the time left and the decision, after a
real training child got SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.harness.processes import Child, module, run

CHILD = "tests.preemption._loop_child"


def _preempted(directory: Path, args: dict[str, object]) -> str:
    """Run the child, SIGTERM it once it is READY, and return ``coci report``'s output."""
    args = {"dir": str(directory), "telemetry": True, **args}
    with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
        while line := child.readline():
            if line.startswith("READY"):
                os.kill(child.pid, signal.SIGTERM)
                break
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            pytest.fail("the child did not stop on the notice")
    report = run(module("coci_core.commands.cli", "report", str(directory)), check=True)
    return report.stdout


def test_report_shows_the_notice_and_the_step_saved(tmp_path: Path) -> None:
    out = _preempted(tmp_path, {"sources": ["TERM@20"], "margin_s": 2})
    line = re.search(
        r"^preemption notice \(SIGTERM\) at step (\d+), [\d.]+ s left: (.*)$", out, re.M
    )
    assert line, out
    step = int(line[1])
    assert step > 5
    assert re.fullmatch(rf"saved step {step} \(the save took [\d.]+ s\)", line[2]), line[0]


def test_report_shows_a_notice_whose_save_did_not_fit(tmp_path: Path) -> None:
    args = {"sources": ["TERM@2"], "margin_s": 0.5, "write_delay_s": 2.5}
    out = _preempted(tmp_path, args)
    line = re.search(r"^preemption notice \(SIGTERM\) at step \d+, [\d.]+ s left: (.*)$", out, re.M)
    assert line, out
    assert line[1].startswith("not saved: the save takes ") and "not started" in line[1]

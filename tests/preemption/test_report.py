"""``coci report`` and the TensorBoard tab's timeline show a preemption notice: its step, the
time left and the decision, after a real training child got SIGTERM (or SIGUSR1, whose save
moves to the last step before the end)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.harness.processes import Child, module, run
from tests.harness.tb import start_tensorboard

CHILD = "tests.preemption._loop_child"


def _preempted(
    directory: Path, args: dict[str, object], signum: signal.Signals = signal.SIGTERM
) -> str:
    """Run the child, signal it once it is READY, and return ``coci report``'s output."""
    args = {"dir": str(directory), "telemetry": True, **args}
    with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
        while line := child.readline():
            if line.startswith("READY"):
                os.kill(child.pid, signum)
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


@pytest.mark.slow
def test_the_report_and_the_tab_show_a_save_moved_before_a_known_end(tmp_path: Path) -> None:
    """SIGUSR1 3 s before the end: ``coci report``'s line and the tab's timeline route (a real
    TensorBoard) show the notice's step, the step its save moved to, and that it was saved."""
    args = {"sources": ["USR1@3"], "margin_s": 1, "step_s": 0.02}
    out = _preempted(tmp_path / "run", args, signal.SIGUSR1)
    line = re.search(
        r"^preemption notice \(SIGUSR1\) at step (\d+), [\d.]+ s left: the save moved to step "
        r"(\d+), [\d.]+ s left: saved step (\d+) \(the save took [\d.]+ s\)$",
        out,
        re.M,
    )
    assert line, out
    noticed, moved = int(line[1]), int(line[2])
    assert noticed < moved == int(line[3])
    server = start_tensorboard(tmp_path, tmp_path / "tensorboard.log")
    try:
        data = server.get_json("/data/plugin/coci/timeline?run=run")
    finally:
        server.stop()
    (notice,) = data["preemptions"]
    assert notice["source"] == "SIGUSR1" and notice["decision"] == "saved"
    assert notice["step"] == noticed and notice["save_step"] == notice["saved"] == moved
    # 3 s ahead, less the time to the step boundary where the ranks learned of it
    assert 0 < notice["time_left_s"] <= 3 and notice["save_s"] > 0
    assert notice["text"] == line[0]
    assert notice["time"] < notice["save_time"]
    # the moved save is a planned checkpoint, taken
    assert {p["step"]: p["state"] for p in data["planned"]}[moved] == "taken"

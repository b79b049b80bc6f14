"""The coci tab's data: finding runs under a log directory, and a run's timeline from its
telemetry records (no TensorBoard needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from coci_core.commands.cli import main
from coci_core.telemetry.report import facts, summarize
from coci_core.telemetry.timeline import POINTER_FILE, find_runs, timeline, write_pointer


def _plan(step: int, next_steps: list[int], t: float) -> dict[str, Any]:
    return {"type": "plan", "step": step, "next_steps": next_steps, "time": t}


def _save(step: int, outcome: str, t: float, **kw: Any) -> dict[str, Any]:
    fields = {"stall_s": 0.002, "persist_s": 0.5, "bytes_written": 2_000_000, "raw_bytes": 6e6}
    return {"type": "save", "step": step, "outcome": outcome, "time": t, **fields, **kw}


def _loss(step: int, t: float) -> dict[str, Any]:
    return {"type": "loss", "step": step, "loss": 2.0 / step, "fitted": 2.1 / step, "time": t}


#: A run that plans 10 and 20, moves 20 to 25, skips a save at 15, is killed after step 29 (its
#: last progress record), restarts from 25 (the new process's first step 9 s after it started)
#: and ends at 40 (the first process's steps 26..29 are lost).
RECORDS = [
    _plan(1, [10, 20], 100.0),
    _loss(5, 105.0),
    _save(10, "committed", 110.0, compressed=True),
    _plan(12, [25], 112.0),
    _save(15, "skipped", 115.0),
    _loss(20, 120.0),
    _save(25, "committed", 125.0),
    _loss(27, 127.0),
    _loss(28, 128.0),
    {"type": "progress", "step": 29, "time": 129.0},
    {"type": "restore", "step": 25, "seconds": 1.5, "bytes_read": 10, "time": 140.0}
    | {"read_s": 1.0, "verify_s": 0.2, "decode_s": 0.0, "load_s": 0.3},
    _plan(26, [35], 141.0),
    {"type": "restart", "step": 25, "seconds": 9.0, "restore_s": 1.5, "time": 141.5}
    | {"since": "process start", "tier": "local"},
    _loss(30, 145.0),
    _save(35, "failed", 150.0, error="OSError: disk full"),
    _loss(40, 155.0),
    _save(40, "committed", 156.0),
]


def _write(directory: Path, records: list[dict[str, Any]] = RECORDS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (directory / "telemetry.jsonl").write_text(text + '{"type": "lo')  # a torn last line
    return directory


def test_a_planned_step_the_run_reached_after_a_restart_is_not_unreached(tmp_path: Path) -> None:
    """A step the first session planned (30) and failed before, which the run reached after the
    restart under a plan that did not have it, was revised away by that plan (before: a hollow
    "planned, not reached" diamond at a step the run reached); a step no session reached (50)
    is still unreached."""
    records = [
        _plan(1, [10, 30], 100.0),
        _save(10, "committed", 110.0),
        {"type": "progress", "step": 20, "time": 120.0},
        {"type": "restore", "step": 10, "seconds": 1.0, "bytes_read": 10, "time": 130.0},
        _plan(11, [25, 50], 131.0),
        _save(25, "committed", 145.0),
        {"type": "end", "step": 40, "time": 160.0},
    ]
    planned = {p["step"]: p for p in timeline(str(_write(tmp_path / "run", records)))["planned"]}
    assert {s: p["state"] for s, p in planned.items()} == {
        10: "taken",
        25: "taken",
        30: "revised",
        50: "unreached",
    }
    assert planned[30]["revised_at"] == 11


def test_timeline_of_a_killed_and_resumed_run(tmp_path: Path) -> None:
    """Planned steps with their fate, saves by outcome with costs in display units, one restart
    with its lost work, lost loss points, wall times, and the report's facts."""
    data = timeline(str(_write(tmp_path / "ck")), "run")
    assert data["run"] == "run" and data["has_time"] and data["t0"] == 100.0
    assert data["last_step"] == 40
    planned = {p["step"]: p for p in data["planned"]}
    assert {s: p["state"] for s, p in planned.items()} == {
        10: "taken",
        20: "revised",
        25: "taken",
        35: "missed",
    }
    assert planned[20]["revised_at"] == 12 and planned[20]["planned_at"] == 1
    assert planned[20]["time"] == pytest.approx(120.0)  # interpolated from the loss's clock
    assert [(s["step"], s["outcome"]) for s in data["saves"]] == [
        (10, "committed"),
        (15, "skipped"),
        (25, "committed"),
        (35, "failed"),
        (40, "committed"),
    ]
    first = data["saves"][0]
    assert first["stall_ms"] == pytest.approx(2.0) and first["persist_s"] == 0.5
    assert first["mb"] == 2.0 and first["compression_x"] == 3.0 and first["compressed"]
    assert data["saves"][3]["mb"] is None and data["saves"][3]["error"] == "OSError: disk full"
    (restart,) = data["restarts"]
    assert restart == {
        "restored": 25,
        "failed_at": 29,
        "lost_steps": 4,
        "restore_s": 1.5,
        "restore_parts_s": {"read": 1.0, "verify": 0.2, "decode": 0.0, "load": 0.3},
        "restart_s": 9.0,
        "restart_since": "process start",
        "time": 140.0,
        "failed_time": 129.0,
        "restored_time": 125.0,
        "exact": False,
        "checkpoint": True,
    }
    assert [p["step"] for p in data["loss"] if p["lost"]] == [27, 28]
    assert [p["session"] for p in data["plans"]] == [0, 0, 1]
    assert data["summary"] == facts(summarize(tmp_path / "ck"))
    # planned as the plan stood: 10, 25 and 35; 20 was revised away before the run got there
    assert data["summary"]["planned"] == 3 and data["summary"]["committed"] == 3
    assert data["summary"]["lost_steps"] == 4 and data["summary"]["skipped"] == 1


def test_records_without_time_have_no_wall_clock(tmp_path: Path) -> None:
    """Telemetry written before records had a time still draws, against steps only."""
    records = [{k: v for k, v in r.items() if k != "time"} for r in RECORDS]
    data = timeline(str(_write(tmp_path / "ck", records)))
    assert not data["has_time"] and data["t0"] is None
    assert len(data["planned"]) == 4 and data["restarts"][0]["lost_steps"] == 4


def test_several_runs_and_logger_versions(tmp_path: Path) -> None:
    """Each checkpoint directory is one run; TensorBoard directories pointing to the same one
    (a resumed run's version_0 and version_1) are that run, and one outside the log directory
    is found through its pointers; checkpoints' step folders are not searched."""
    logs = tmp_path / "logs"
    _write(logs / "a" / "coci")
    _write(logs / "b" / "coci")
    (logs / "a" / "coci" / "step-0000000010").mkdir()
    _write(logs / "a" / "coci" / "step-0000000010")  # never a run
    outside = _write(tmp_path / "elsewhere" / "coci")
    for version in ("version_0", "version_1"):
        write_pointer(logs / "lightning_logs" / version, outside)
    write_pointer(logs / "a" / "coci" / "tensorboard", logs / "a" / "coci")  # found twice: once
    assert find_runs(logs) == {
        "a/coci": str(logs / "a" / "coci"),
        "b/coci": str(logs / "b" / "coci"),
        "lightning_logs": str(outside),
    }


def test_pointer_follows_moved_directories(tmp_path: Path) -> None:
    """A pointer's relative path wins, so a log and checkpoint directory moved together still
    find each other; a pointer to nothing is ignored."""
    ck = _write(tmp_path / "old" / "coci")
    write_pointer(tmp_path / "old" / "tb", ck)
    shutil.move(tmp_path / "old", tmp_path / "new")
    assert find_runs(tmp_path / "new" / "tb") == {"tb": str(tmp_path / "new" / "coci")}
    (tmp_path / "new" / "tb" / POINTER_FILE).write_text('{"checkpoint_dir": "/nowhere"}')
    assert find_runs(tmp_path / "new" / "tb") == {}


def test_report_plot_draws_the_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """coci report --plot writes a PNG, and the report ends with the facts the tab shows."""
    pytest.importorskip("matplotlib")
    ck = _write(tmp_path / "ck")
    out = tmp_path / "timeline.png"
    assert main(["report", str(ck), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    text = capsys.readouterr().out
    # the restore does not say the step reached: the lost work is a lower bound
    assert "lost work: at least 4 steps over 1 restart after a failure" in text
    assert "restored step 25 in 1.50 s (read 1.00, verify 0.20, load 0.30 s)" in text
    assert "first step 9.0 s after process start" in text
    assert f"timeline drawn to {out}" in text

"""Two runs written one after the other into one directory: every record carries its run's id,
and ``coci report`` and the TensorBoard tab speak of the latest run, saying there were earlier
ones (before: "checkpoints committed: 4 at steps [4, 8, 4, 8]", the two runs as one)."""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.commands.cli import main
from coci_core.telemetry import JsonlTelemetry, read_jsonl
from coci_core.telemetry.events import JsonlRecords
from coci_core.telemetry.objects import ObjectTelemetry
from coci_core.telemetry.report import summarize
from coci_core.telemetry.timeline import timeline


def _session(directory: Path | str, sink: JsonlRecords, *, restore: bool = False) -> None:
    """A session of a run: steps 1-8 (or on from the newest checkpoint), saves every 4."""
    with CheckpointManager(directory, listeners=[sink]) as mgr:
        first = 1
        if restore:
            mgr.restore()
            first = (mgr.latest_step() or 0) + 1
        for step in range(first, first + 8):
            sink.record_progress(step)
            if step % 4 == 0:
                mgr.save(step, {"w": torch.full((4,), float(step))})
    sink.close()


def _report(directory: Path | str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["report", str(directory)]) == 0
    return out.getvalue()


def test_two_runs_one_after_the_other_are_reported_apart(tmp_path: Path) -> None:
    for _ in range(2):
        _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"))
    records = read_jsonl(tmp_path / "telemetry.jsonl")
    first, second = records[0]["run_id"], records[-1]["run_id"]
    assert first != second and {r["run_id"] for r in records} == {first, second}
    text = _report(tmp_path)
    assert text.startswith(
        "this directory's telemetry holds 2 runs, one after the other: this report is of the "
        f"latest, run {second}; the earlier ones:\n"
        f"  run {first}: 8 steps, 2 checkpoints committed at steps [4, 8]\n"
    ), text
    assert "checkpoints committed: 2 at steps [4, 8]\n" in text
    shown = timeline(str(tmp_path))
    assert shown["earlier_runs"] == 1 and f"run {first}" in shown["earlier_note"]
    assert [s["step"] for s in shown["saves"] if s.get("outcome") == "committed"] == [4, 8]


def test_a_directory_of_many_runs_lists_the_ten_newest_earlier_ones(tmp_path: Path) -> None:
    """A directory a job starts anew in again and again (a nightly run): the report and the
    tab list the 10 newest earlier runs and count the older ones, so what they say stays the
    same length however many runs came before (before: a line for every earlier run, above
    the report; 200,000 runs printed 14 MB and put it all into the tab's note)."""
    for _ in range(13):
        _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"))
    runs = list(dict.fromkeys(r["run_id"] for r in read_jsonl(tmp_path / "telemetry.jsonl")))
    assert len(runs) == 13
    text = _report(tmp_path)
    listed = [line for line in text.splitlines() if line.startswith("  run ")]
    assert [line.split(":")[0] for line in listed] == [f"  run {run}" for run in runs[2:12]]
    assert text.startswith(
        "this directory's telemetry holds 13 runs, one after the other: this report is of the "
        f"latest, run {runs[12]}; the earlier ones:\n  (2 older runs not listed)\n"
        f"  run {runs[2]}: 8 steps, 2 checkpoints committed at steps [4, 8]\n"
    ), text
    shown = timeline(str(tmp_path))
    assert shown["earlier_runs"] == 12
    assert "(2 older runs not listed)" in shown["earlier_note"]
    note = shown["earlier_note"]
    assert f"run {runs[1]}" not in note and f"run {runs[2]}" in note


def test_a_resumed_run_is_one_run(tmp_path: Path) -> None:
    """A session that restores goes on with the run (its id kept through the progress file);
    so does one that starts over (no checkpoint restored) after a session that was killed."""
    _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"))
    _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"), restore=True)
    killed = JsonlTelemetry(tmp_path / "telemetry.jsonl")
    with CheckpointManager(tmp_path, listeners=[killed]) as mgr:
        mgr.restore()
    killed.record_progress(20)
    for fd in (killed._fd, killed._progress_fd):  # killed: no end record
        os.close(fd)
    _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"))
    records = read_jsonl(tmp_path / "telemetry.jsonl")
    assert len({r["run_id"] for r in records}) == 1
    assert [r["type"] for r in records].count("start") == 1
    summary = summarize(tmp_path)
    assert summary.earlier_runs == [] and len(summary.resumes) == 3
    assert "runs, one after the other" not in _report(tmp_path)


def test_records_without_a_run_id_read_as_one_run(tmp_path: Path) -> None:
    """A file written before records carried a run id reads as before, and a run resumed
    from it keeps its earlier sessions (its progress file names no run)."""
    for restore in (False, True):
        _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"), restore=restore)
    lines = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    old = [json.loads(line) for line in lines]
    for r in old:
        del r["run_id"]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    progress = tmp_path / "telemetry.progress"
    progress.write_text(" ".join(progress.read_text().split()[:2]) + "\n")  # as before run ids
    summary = summarize(tmp_path)
    assert summary.earlier_runs == [] and summary.run_id is None
    assert [s["step"] for s in summary.committed] == [4, 8, 12, 16]
    _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"), restore=True)
    summary = summarize(tmp_path)
    assert summary.earlier_runs == [] and summary.run_id is not None
    assert [s["step"] for s in summary.committed] == [4, 8, 12, 16, 20, 24]


def test_a_new_run_after_records_without_a_run_id_is_a_run_of_its_own(tmp_path: Path) -> None:
    """After a file written before records carried a run id, a run that begins anew (no
    restore) is reported apart from it (before: one run, "checkpoints committed: 4 at steps
    [4, 8, 4, 8]"), as two runs of this version are."""
    _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"))
    old = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    for r in old:
        del r["run_id"]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    progress = tmp_path / "telemetry.progress"
    progress.write_text(" ".join(progress.read_text().split()[:2]) + "\n")  # as before run ids
    _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"))
    summary = summarize(tmp_path)
    assert [s["step"] for s in summary.committed] == [4, 8] and summary.run_id is not None
    assert [[s["step"] for s in run.committed] for run in summary.earlier_runs] == [[4, 8]]
    assert summary.earlier_runs[0].run_id is None


@pytest.mark.parametrize("token", [b"../../etc/passwd", b"\xff" * 16, b"A" * 16, b"e" * 15])
def test_a_forged_run_in_the_progress_file_starts_a_run_of_its_own(
    tmp_path: Path, token: bytes
) -> None:
    """A progress file whose run is not one coci writes is not carried into the records:
    the session's records are all read back, under a run id of its own."""
    (tmp_path / "telemetry.progress").write_bytes(b"8 end " + token + b"\n")
    _session(tmp_path, JsonlTelemetry(tmp_path / "telemetry.jsonl"))
    records = read_jsonl(tmp_path / "telemetry.jsonl")
    runs = {r["run_id"] for r in records}
    assert len(runs) == 1 and len(records) == len(
        (tmp_path / "telemetry.jsonl").read_text().splitlines()
    )
    assert runs.pop().encode() != token


def test_object_store_runs_are_told_apart(tmp_path: Path) -> None:
    """Under a URL, each session's object: a restoring session takes the run of the newest
    object, any other starts its own."""
    url = f"file://{tmp_path / 'run'}"
    _session(url, ObjectTelemetry(url, session="20260101T000000000000Z-a"))
    _session(url, ObjectTelemetry(url, session="20260101T000001000000Z-b"), restore=True)
    _session(url, ObjectTelemetry(url, session="20260101T000002000000Z-c"))
    summary = summarize(url)
    assert [s["step"] for s in summary.committed] == [4, 8]
    (earlier,) = summary.earlier_runs
    assert [s["step"] for s in earlier.committed] == [4, 8, 12, 16]
    assert earlier.run_id != summary.run_id


def test_a_sink_choosing_its_run_holds_up_no_other_sink() -> None:
    """A sink's choice of its run may wait on its store (an object store's sink lists it);
    another sink of the process chooses its own meanwhile (before: one lock for every sink of
    the process, held through that wait)."""
    import threading

    listing = threading.Event()
    release = threading.Event()

    class SlowStore(JsonlRecords):
        def previous_run_id(self) -> str | None:
            listing.set()
            release.wait(timeout=60)
            return "a" * 16

    slow, other = SlowStore(), JsonlRecords()
    first = threading.Thread(target=slow._run_of, args=("restore",), daemon=True)
    first.start()
    assert listing.wait(timeout=60)
    second = threading.Thread(target=other._run_of, args=(None,), daemon=True)
    second.start()
    second.join(timeout=30)
    chosen = not second.is_alive()
    release.set()
    first.join(timeout=30)
    assert chosen and other.run_id is not None and other.run_id != slow.run_id == "a" * 16

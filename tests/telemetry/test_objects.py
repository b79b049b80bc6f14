"""Telemetry under a URL checkpoint directory: one object per session, read by ``coci report``."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.telemetry import parse_jsonl
from coci_core.telemetry.objects import TELEMETRY_DIR, ObjectTelemetry, read_objects
from coci_core.telemetry.report import facts, summarize
from tests.harness.processes import Child, child_env, script
from tests.harness.s3 import SECRET_KEY, S3Server


def _save(url: str, steps: list[int], sink: ObjectTelemetry, **options: Any) -> None:
    with CheckpointManager(url, listeners=[sink], keep_last=2, **options) as mgr:
        for step in steps:
            mgr.save(step, {"w": torch.full((250_000,), float(step))}).wait()
    sink.close()


def test_s3_run_is_reported_from_its_objects(s3_server: S3Server, s3_prefix: str) -> None:
    """A manager on S3 with the object sink: each session leaves one object under
    ``telemetry/`` that retention and a later writer's clean-up leave alone, without the
    secret; ``coci report s3://...`` (credentials from the environment) reads the sessions in
    the order they ran (two runs here: the second restored nothing)."""
    url = f"s3://{s3_prefix}/run"
    opts = s3_server.storage_options
    _save(url, [10, 20, 30], ObjectTelemetry(url, opts), storage_options=opts)
    _save(url, [40, 50], ObjectTelemetry(url, opts), storage_options=opts)
    fs = s3_server.filesystem()
    objects = sorted(fs.ls(f"{s3_prefix}/run/{TELEMETRY_DIR}", detail=False))
    assert len(objects) == 2 and all(o.endswith(".jsonl") for o in objects)
    texts = [fs.cat_file(o).decode() for o in objects]
    assert [[r["step"] for r in parse_jsonl(t)] for t in texts] == [[10, 20, 30], [40, 50]]
    assert all(SECRET_KEY not in t and s3_server.endpoint not in t for t in texts)
    ls = s3_server.run_coci("ls", url)
    assert ls.returncode == 0, ls.stderr
    # keep_last=2 (per run) removed step 10; the telemetry objects stayed.
    assert [line.split()[0] for line in ls.stdout.splitlines()[1:]] == ["20", "30", "40", "50"]
    report = s3_server.run_coci("report", url)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    # the second session restored nothing: a run of its own, reported apart from the first
    assert lines[0].startswith("this directory's telemetry holds 2 runs, one after the other")
    assert lines[1].endswith(": 30 steps, 3 checkpoints committed at steps [10, 20, 30]")
    assert lines[3] == "checkpoints committed: 2 at steps [40, 50]"
    rows = [line.split() for line in lines if line.strip().split(" ")[0].isdigit()]
    assert [int(r[0]) for r in rows] == [40, 50]
    assert all(1.0 <= float(r[4]) < 1.1 for r in rows)  # MB written: 250,000 float32 each
    assert SECRET_KEY not in report.stdout + report.stderr


_S3_LOOP = """
import sys, torch
from coci_core import CheckpointManager
from coci_core.errors import NoCheckpointError
from coci_core.telemetry.objects import ObjectTelemetry
url, kill = sys.argv[1], int(sys.argv[2])
telemetry = ObjectTelemetry(url)  # credentials and endpoint from the environment
mgr = CheckpointManager(url, listeners=[telemetry])
start = 0
try:
    start = mgr.restore()["step"]
except NoCheckpointError:
    pass
for step in range(start + 1, 31):
    telemetry.record_progress(step)
    if step % 10 == 0:
        mgr.save(step, {"w": torch.full((3,), float(step)), "step": step}).wait()
        telemetry.flush()  # its records are in the store; the next ones wait for the next put
    if step == kill:
        print(f"AT {step}", flush=True)
        sys.stdin.readline()
mgr.close()
telemetry.close()
"""


def test_lost_work_of_a_killed_s3_run_is_a_lower_bound(s3_server: S3Server, s3_prefix: str) -> None:
    """A run on S3 SIGKILLed at step 27, its records put up to step 20 (the object store's
    telemetry is put every 2-30 s), resumed from step 20 by a new process: the report and the
    tab say at least 0 steps lost, the exact number unknown (before: "0 steps of work lost")."""
    url = f"s3://{s3_prefix}/run"
    env = child_env(s3_server.env, drop_prefixes=("AWS_", "FSSPEC_"))
    with Child(script(_S3_LOOP, url, "27"), env=env) as child:
        assert child.kill_at("AT 27") == -9
    with Child(script(_S3_LOOP, url, "-1"), env=env) as child:
        assert child.wait(120) == 0
    report = s3_server.run_coci("report", url)
    assert report.returncode == 0, report.stderr
    out = report.stdout
    assert "restart: restored step 20" in out
    assert "the run had reached step 20 or further" in out
    assert "at least 0 steps of work lost and redone, the exact number unknown" in out
    assert "lost work: at least 0 steps over 1 restart after a failure" in out
    (restart,) = [r for r in summarize(url, s3_server.storage_options).restarts]
    assert (restart.restored, restart.failed_at, restart.exact) == (20, 20, False)
    assert facts(summarize(url, s3_server.storage_options))["lost_exact"] is False


def test_report_of_a_remote_tier_points_to_the_local_one(
    s3_server: S3Server, s3_prefix: str, tmp_path: Path
) -> None:
    """A two-tier manager keeps telemetry local: ``coci report`` of the remote URL finds
    none and says where it is, in one line, exit code 1."""
    remote = f"s3://{s3_prefix}/remote"
    with CheckpointManager(
        tmp_path / "local", remote=remote, remote_storage_options=s3_server.storage_options
    ) as mgr:
        mgr.save(7, {"w": torch.zeros(8)}).wait()
    assert s3_server.run_coci("ls", remote).returncode == 0  # the step is uploaded
    report = s3_server.run_coci("report", remote)
    assert report.returncode == 1
    assert report.stdout == ""
    assert report.stderr.count("\n") == 1
    assert "no telemetry in" in report.stderr and "local directory" in report.stderr


def test_a_failed_put_never_fails_a_save_and_is_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the telemetry folder unwritable (a file is in its place) every save still
    commits, the failed put is a warning, and the next flush, once it can, writes every
    record."""
    run = tmp_path / "run"
    run.mkdir()
    (run / TELEMETRY_DIR).write_text("in the way")
    url = f"file://{run}"
    sink = ObjectTelemetry(url)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="coci_core.telemetry.objects"),
            CheckpointManager(url, listeners=[sink], keep_last=None) as mgr,
        ):
            for step in (1, 2, 3):
                mgr.save(step, {"w": torch.zeros(4)}).wait()
            sink.flush()
            assert mgr.steps() == [1, 2, 3]
        assert sink.unsaved == 3
        assert "could not write the telemetry" in caplog.text
        (run / TELEMETRY_DIR).unlink()
        sink.flush()
        assert sink.unsaved == 0
    finally:
        sink.close()
    assert [r["step"] for r in summarize(url).committed] == [1, 2, 3]


def test_a_committed_save_is_put_in_the_background(tmp_path: Path) -> None:
    """Without flush or close, a committed save reaches the store from the sink's thread."""
    url = f"file://{tmp_path / 'run'}"
    sink = ObjectTelemetry(url, gap_s=0.0, delay_s=3600.0)
    put = threading.Event()
    write_file = sink.storage.write_file

    def recording_write(*args: Any, **kwargs: Any) -> int:
        n = write_file(*args, **kwargs)
        put.set()
        return n

    sink.storage.write_file = recording_write  # type: ignore[method-assign]
    try:
        with CheckpointManager(url, listeners=[sink]) as mgr:
            mgr.save(5, {"w": torch.zeros(4)}).wait()
            assert put.wait(timeout=30)
            records = read_objects(sink.storage)
            assert records is not None and [r["step"] for r in records] == [5]
    finally:
        sink.close()


def test_no_records_no_object(tmp_path: Path) -> None:
    """A session that recorded nothing puts nothing, and ``summarize`` says there is none."""
    url = f"file://{tmp_path / 'run'}"
    ObjectTelemetry(url).close()
    with pytest.raises(FileNotFoundError, match="no telemetry in"):
        summarize(url)

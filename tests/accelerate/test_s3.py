"""CociCheckpointer with an ``s3://`` dirpath, on a real Accelerator and a real S3 server."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager, ConfigError
from tests.accelerate.loop import train
from tests.harness.s3 import SECRET_KEY, S3Server

BATCH = 16


class _Stop(Exception):
    pass


def _stop(accelerator: Accelerator) -> None:
    raise _Stop


def test_s3_dirpath_resumes_bit_exact(
    s3_server: S3Server,
    s3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop checkpointing to S3, stopped at step 43, resumes from the bucket (step 40) and
    ends bit-identical; nothing lands in a local ``s3:`` directory; no secret in the logs;
    ``coci report s3://...`` shows both sessions' saves and the restart."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.DEBUG)
    url = f"s3://{s3_prefix}/run"
    opts = s3_server.storage_options
    reference = train(str(tmp_path / "ref"), 70)
    AcceleratorState._reset_state(True)
    with pytest.raises(_Stop):
        train(
            str(tmp_path / "run"), 70, kill_at=43, on_kill=_stop, dirpath=url, storage_options=opts
        )
    with CheckpointManager(url, storage_options=opts, keep_last=None) as reader:
        assert reader.steps()[-1] == 40
    AcceleratorState._reset_state(True)
    resumed = train(str(tmp_path / "run"), 70, dirpath=url, storage_options=opts)
    assert resumed["start"] == 40
    assert resumed["digest"] == reference["digest"]
    assert resumed["seen"] == reference["seen"][40 * BATCH :]
    local = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")]
    assert not [p for p in local if "s3:" in p]
    assert not [p for p in local if p.startswith("run") and ("coci" in p or "telemetry" in p)]
    assert SECRET_KEY not in caplog.text
    # coci report reads both sessions' telemetry from the bucket, in the order they ran.
    report = s3_server.run_coci("report", url)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0] == f"checkpoints committed: 14 at steps {list(range(5, 75, 5))}"
    assert "restart: restored step 40 in" in report.stdout


def test_storage_options_are_checked_at_construction(tmp_path: Path) -> None:
    """storage_options: a dict with str keys, for a URL dirpath only; errors hide values."""
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="storage_options") as info:
        CociCheckpointer(accelerator, "s3://b/run", storage_options=[SECRET_KEY])  # type: ignore[arg-type]
    assert SECRET_KEY not in str(info.value)
    with pytest.raises(ConfigError, match="fsspec URL"):
        CociCheckpointer(accelerator, str(tmp_path / "c"), storage_options={"secret": SECRET_KEY})

"""CociCheckpointer with an ``s3://`` dirpath, on a real Accelerator and a real S3 server."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager, ConfigError
from tests.accelerate import example
from tests.accelerate.loop import train
from tests.harness.processes import Child, child_env, module, run
from tests.harness.results import result_rows
from tests.harness.s3 import SECRET_KEY, S3Server

BATCH = 16
_EXAMPLE = "tests.accelerate.example"


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


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout on the path; the AWS_* variables of ``extra`` only."""
    return child_env(extra, drop_prefixes=("AWS_", "FSSPEC_"))


def _run_until(
    args: list[str], mark: str, env: dict[str, str], cwd: Path, before_kill: Callable[[], object]
) -> None:
    """Start the example script; at its line starting with ``mark``, call ``before_kill()`` and
    SIGKILL it."""
    with Child(module(_EXAMPLE, *args), env=env, stderr=subprocess.DEVNULL, cwd=cwd) as child:
        assert child.kill_at(mark, before_kill) == -signal.SIGKILL


def _finish(args: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    out = run(module(_EXAMPLE, *args), timeout_s=300, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = result_rows(out.stdout)
    return row


def _local_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _open_uploads(server: S3Server, prefix: str) -> list[str]:
    fs = server.filesystem()
    bucket, key, _ = fs.split_path(prefix)
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    return [u["Key"] for u in listed.get("Uploads", [])]


@pytest.mark.slow
@pytest.mark.faults
def test_sigkill_during_a_multipart_upload_of_the_state(
    s3_server: S3Server, s3_prefix: str, tmp_path: Path
) -> None:
    """The example loop with a 40 MB state (three 16 MiB parts) checkpointing to ``s3://``
    every 4 steps, SIGKILLed with the upload of step 8 open on the server (two parts sent):
    step 4 restores, the killed upload is aborted, and the resumed run ends bit-identical."""
    url = f"s3://{s3_prefix}/run"
    opts = s3_server.storage_options
    env = _env()
    options = ["--storage-options", json.dumps(opts), "--ballast-mb", "40"]
    options += ["--compression", "none", "--dirpath", url]
    reference = example.train_like_example(str(tmp_path / "ref"), epochs=1, ballast_mb=40)
    open_at_kill: list[str] = []
    _run_until(
        [str(tmp_path / "run"), "1", "--hold-upload", "8", *options],
        "UPLOADING 8",
        env,
        tmp_path,
        lambda: open_at_kill.extend(_open_uploads(s3_server, s3_prefix)),
    )
    assert len(open_at_kill) == 1 and "step-0000000008" in open_at_kill[0]
    resumed = _finish([str(tmp_path / "run"), "1", *options], env, tmp_path)
    assert resumed["start"] == 4
    assert resumed["seen"] == reference["seen"][4 * example.BATCH :]
    assert resumed["digest"] == reference["digest"]
    assert _open_uploads(s3_server, s3_prefix) == []
    with CheckpointManager(url, storage_options=opts, keep_last=None) as reader:
        assert reader.steps() == [4, 8, 12]
        assert reader.manifest(8).nbytes > 40 * 2**20


def test_storage_options_are_checked_at_construction(tmp_path: Path) -> None:
    """storage_options: a dict with str keys, for a URL dirpath only; errors hide values."""
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="storage_options") as info:
        CociCheckpointer(accelerator, "s3://b/run", storage_options=[SECRET_KEY])  # type: ignore[arg-type]
    assert SECRET_KEY not in str(info.value)
    with pytest.raises(ConfigError, match="fsspec URL"):
        CociCheckpointer(accelerator, str(tmp_path / "c"), storage_options={"secret": SECRET_KEY})

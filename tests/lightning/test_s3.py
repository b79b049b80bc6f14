"""CociCheckpoint with an ``s3://`` dirpath, on a real Trainer and a real S3 server."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from coci_core import CheckpointManager, ConfigError
from coci_lightning import CociCheckpoint
from tests.harness.processes import child_env, module, run
from tests.harness.s3 import SECRET_KEY, S3Server
from tests.lightning.models import DigitsModel, digest

_CHILD = "tests.lightning._child"


def _fit(root: Path, max_steps: int, callback: CociCheckpoint | None, seed: int, **kw: Any) -> Any:
    pl.seed_everything(seed, verbose=False)
    model = DigitsModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=CSVLogger(root / "logs", name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[callback] if callback else [],
        log_every_n_steps=1,
    )
    trainer.fit(model, **kw)
    return model, trainer


def _local_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_s3_dirpath_saves_to_the_bucket_and_resumes_exactly(
    s3_server: S3Server,
    s3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Checkpoints go to the bucket (no local directory named ``s3:``), telemetry to the
    Trainer's logger, and ``fit(ckpt_path="last")`` resumes from S3 bit-exactly."""
    monkeypatch.chdir(tmp_path)  # a relative "s3:/..." directory would land here
    caplog.set_level(logging.DEBUG)
    url = f"s3://{s3_prefix}/run"
    opts = s3_server.storage_options
    reference, _ = _fit(tmp_path / "ref", 40, None, seed=1)

    def callback() -> CociCheckpoint:
        return CociCheckpoint(
            dirpath=url, storage_options=opts, policy="every_n_steps", every_n_steps=5
        )

    first = callback()
    _, trainer = _fit(tmp_path / "a", 23, first, seed=1)
    with CheckpointManager(url, storage_options=opts, keep_last=None) as reader:
        assert reader.steps() == [15, 20, 23]  # keep_last=3, and the save at train end
    assert not [p for p in _local_files(tmp_path) if "s3:" in p]
    # Telemetry: the Trainer's CSV logger got the saves' metrics; nothing coci wrote is local.
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(row.get("coci/stall_ms") for row in rows)
    assert not [p for p in _local_files(tmp_path / "a") if "coci" in p or "telemetry" in p]

    resumed, _ = _fit(tmp_path / "b", 40, callback(), seed=99, ckpt_path="last")
    assert resumed.seen == reference.seen[23 * 16 :]
    assert digest(resumed) == digest(reference)
    assert "restores step 23" in caplog.text
    assert SECRET_KEY not in caplog.text
    assert SECRET_KEY not in repr(first) + repr(first.checkpointer)


def test_storage_options_are_checked_at_construction(tmp_path: Path) -> None:
    """storage_options must be a dict with str keys, for an fsspec URL dirpath only; the error
    does not show the values."""
    with pytest.raises(ConfigError, match="storage_options") as info:
        CociCheckpoint(dirpath="s3://b/run", storage_options=["key", SECRET_KEY])  # type: ignore[arg-type]
    assert SECRET_KEY not in str(info.value)
    with pytest.raises(ConfigError, match="fsspec URL"):
        CociCheckpoint(dirpath=tmp_path, storage_options={"secret": SECRET_KEY})
    with pytest.raises(ConfigError, match="fsspec URL"):
        CociCheckpoint(storage_options={"secret": SECRET_KEY})
    assert CociCheckpoint(dirpath="s3://b/run", storage_options={}).storage_options == {}


def test_refused_credentials_end_the_script_with_one_traceback(
    s3_server: S3Server, s3_prefix: str, tmp_path: Path
) -> None:
    """A Lightning script whose S3 secret is wrong ends with one traceback and the line that
    says what to check (not botocore's and s3fs's errors chained before it)."""
    opts = {**s3_server.storage_options, "secret": "wrong"}
    env = child_env(drop_prefixes=("AWS_", "FSSPEC_"))
    remote = ["--dirpath", f"s3://{s3_prefix}/refused", "--storage-options", json.dumps(opts)]
    done = run(module(_CHILD, str(tmp_path / "run"), "4", *remote), env=env, timeout_s=300)
    assert done.returncode == 1
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr[-4000:]
    assert "exception was the direct cause" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("coci_core.errors.StorageError") and "access denied" in last, last
    assert "check the credentials" in last
    assert "wrong" not in last and SECRET_KEY not in done.stderr

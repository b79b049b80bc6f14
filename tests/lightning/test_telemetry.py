"""A Lightning run's coci telemetry: TensorBoard (scalars and the coci tab's pointer), the
Trainer's loggers, coci report."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from coci_core.commands.cli import main
from coci_core.telemetry.timeline import POINTER_FILE, find_runs, timeline
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel


def _fit(root: Path, logger: object, steps: int = 20, resume: bool = False) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=logger,
        enable_progress_bar=False,  # type: ignore[arg-type]
        enable_model_summary=False,
        default_root_dir=root,
        log_every_n_steps=1,
        callbacks=[CociCheckpoint(policy="every_n_steps", every_n_steps=5, resume=resume)],
    )
    trainer.fit(DigitsModel())


def _events(log_dir: str) -> EventAccumulator:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_written_through_the_trainers_tensorboard_logger(tmp_path: Path) -> None:
    """With a TensorBoardLogger, the coci/ scalars land in its event file (no layout), and its
    version folder points the coci tab at the checkpoint directory."""
    logger = TensorBoardLogger(tmp_path, name="tb")
    _fit(tmp_path, logger)
    acc = _events(logger.log_dir)
    tags = acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("coci/stall_ms")] == [5, 10, 15, 20]
    assert {t for t in tags if t.startswith("coci/")} <= {
        "coci/stall_ms",
        "coci/persist_s",
        "coci/checkpoint_MB",
        "coci/expected_overhead_s",
    }
    assert any(e.value > 0 for e in acc.Scalars("coci/checkpoint_MB"))
    assert "train_loss" in tags  # the user's own metrics are in the same run
    assert acc.Tags()["tensors"] == []  # no custom-scalars layout
    assert (Path(logger.log_dir) / POINTER_FILE).is_file()
    assert find_runs(tmp_path / "tb") == {"version_0": str(tmp_path / "coci")}


def test_resumed_run_is_one_run_across_logger_versions(tmp_path: Path) -> None:
    """A run resumed in a new Trainer logs to version_1, yet the coci tab shows one run: both
    versions point to the same checkpoint directory, whose telemetry has both sessions."""
    _fit(tmp_path, TensorBoardLogger(tmp_path, name="tb"), steps=10)
    _fit(tmp_path, TensorBoardLogger(tmp_path, name="tb"), steps=20, resume=True)
    versions = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert versions == ["version_0", "version_1"]
    assert all((tmp_path / "tb" / v / POINTER_FILE).is_file() for v in versions)
    runs = find_runs(tmp_path / "tb")
    assert runs == {"tb": str(tmp_path / "coci")}  # named after the folder of both versions
    data = timeline(runs["tb"], "tb")
    assert [s["step"] for s in data["saves"]] == [5, 10, 15, 20]
    # the second fit went on from where the first ended: a resume, no failure, nothing lost
    assert data["restarts"] == [] and [r["restored"] for r in data["resumes"]] == [10]
    assert data["summary"]["restarts"] == 0 and data["summary"]["lost_steps"] == 0


def test_without_a_logger_coci_writes_its_own_tensorboard_run(tmp_path: Path) -> None:
    """With logger=False the scalars go to coci's own writer under the checkpoint directory,
    and the tab finds the run from there or from above."""
    _fit(tmp_path, False)
    acc = _events(str(tmp_path / "coci" / "tensorboard"))
    assert [e.step for e in acc.Scalars("coci/stall_ms")] == [5, 10, 15, 20]
    assert find_runs(tmp_path) == {"coci": str(tmp_path / "coci")}
    assert find_runs(tmp_path / "coci" / "tensorboard") == {"tensorboard": str(tmp_path / "coci")}


def test_other_loggers_get_save_metrics(tmp_path: Path) -> None:
    """A CSVLogger receives coci/stall_ms, persist_ms and bytes_written at each save step."""
    logger = CSVLogger(tmp_path, name="csv")
    _fit(tmp_path, logger)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("coci/stall_ms")]
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20]
    assert all(float(r["coci/bytes_written"]) > 0 for r in rows)


def test_coci_report(tmp_path: Path, capsys: object) -> None:
    """coci report prints the committed steps, the per-save costs, the plan and the TB line."""
    _fit(tmp_path, False)
    assert main(["report", str(tmp_path / "coci")]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "checkpoints committed: 4 at steps [5, 10, 15, 20]" in out
    assert "plan: policy every_n_steps" in out
    assert f"coci tab: tensorboard --logdir {tmp_path / 'coci' / 'tensorboard'}" in out
    assert main(["report", str(tmp_path)]) == 1

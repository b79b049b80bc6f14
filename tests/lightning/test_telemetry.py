"""A Lightning run's coci telemetry: the TensorBoard panel, the Trainer's loggers, coci report."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from coci_core.commands.cli import main
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel


def _fit(root: Path, logger: object, steps: int = 20) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=logger,
        enable_progress_bar=False,  # type: ignore[arg-type]
        enable_model_summary=False,
        default_root_dir=root,
        log_every_n_steps=1,
        callbacks=[CociCheckpoint(policy="every_n_steps", every_n_steps=5)],
    )
    trainer.fit(DigitsModel())


def _events(log_dir: str) -> EventAccumulator:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_panel_written_through_the_trainers_tensorboard_logger(tmp_path: Path) -> None:
    """With a TensorBoardLogger, the coci series and the 'coci' layout land in its event file."""
    logger = TensorBoardLogger(tmp_path, name="tb")
    _fit(tmp_path, logger)
    acc = _events(logger.log_dir)
    tags = acc.Tags()["scalars"]
    committed = [e.step for e in acc.Scalars("coci/save/committed_step")]
    assert committed == [5, 10, 15, 20]
    assert [e.value for e in acc.Scalars("coci/save/committed_step")] == [5, 10, 15, 20]
    assert {"coci/save/stall_ms", "coci/save/persist_ms", "coci/loss/observed"} <= set(tags)
    assert any(e.value > 0 for e in acc.Scalars("coci/save/bytes_written"))
    assert "train_loss" in tags  # the user's own metrics are in the same run
    layout_events = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(layout_events[-1].tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == ["coci"]
    charts = [chart.title for chart in layout.category[0].chart]
    assert charts == ["planned vs actual", "cost", "loss fit", "compression"]


def test_without_a_logger_coci_writes_its_own_tensorboard_run(tmp_path: Path) -> None:
    """With logger=False the panel goes to coci's own writer under the checkpoint directory."""
    _fit(tmp_path, False)
    acc = _events(str(tmp_path / "coci" / "tensorboard"))
    assert [e.step for e in acc.Scalars("coci/save/committed_step")] == [5, 10, 15, 20]


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
    assert f"tensorboard --logdir {tmp_path / 'coci' / 'tensorboard'}" in out
    assert main(["report", str(tmp_path)]) == 1

"""``ckpt_path="best"`` with CociCheckpoint as the only checkpoint callback: with a ``monitor``,
the kept coci checkpoint with the lowest monitored value; without one, the newest kept
checkpoint (as ModelCheckpoint() without a monitor); with none kept, a ValueError saying what
to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from coci_core.engine.format.manifest import step_dir_name
from coci_lightning import CociCheckpoint
from tests.lightning.models import digest
from tests.lightning.test_usual_script import _EvalModel, _trainer

# the save at step 4 comes before the first validation: the monitor is not logged yet
pytestmark = pytest.mark.filterwarnings("ignore:`CociCheckpoint\\(monitor='val_loss'\\)` could not")

# the validation loss each validation logs, by the training step it follows
VAL_LOSS = {4: 3.0, 8: 1.0, 12: 2.0, 16: 5.0, 20: 4.0}


class _Scripted(_EvalModel):
    """Logs ``val_loss`` from :data:`VAL_LOSS`, so that the best step is known."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", VAL_LOSS[self.trainer.global_step])


def _fit(root: Path, max_steps: int, keep_last: int | None, **fit: Any) -> tuple[Any, Any]:
    pl.seed_everything(3, verbose=False)
    model = _Scripted()
    coci = CociCheckpoint(
        monitor="val_loss", policy="every_n_steps", every_n_steps=4, keep_last=keep_last
    )
    trainer = _trainer(
        root, max_steps, [coci], val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0
    )
    trainer.fit(model, **fit)
    return model, trainer


def test_best_is_the_kept_checkpoint_with_the_lowest_monitored_value(tmp_path: Path) -> None:
    model, trainer = _fit(tmp_path, 16, keep_last=None)
    coci = trainer.checkpoint_callback
    best = str(tmp_path / "coci" / step_dir_name(8))
    assert coci.best_model_path == best
    assert coci.best_model_score == 1.0
    final = digest(model)
    result = trainer.test(ckpt_path="best")
    assert trainer.ckpt_path == best
    assert "test_loss" in result[0]
    tested = digest(model)
    assert tested == digest(_Scripted.load_from_checkpoint(best))
    assert tested != final
    # a later fit resumes from "last" and still knows the scores of the earlier saves
    _, resumed = _fit(tmp_path, 20, keep_last=None, ckpt_path="last")
    assert resumed.checkpoint_callback.best_model_path == best
    resumed.test(ckpt_path="best")
    assert resumed.ckpt_path == best


def test_best_skips_a_checkpoint_retention_deleted(tmp_path: Path) -> None:
    """With keep_last=2 only steps 12 and 16 are kept: the best of those is 12."""
    _, trainer = _fit(tmp_path, 16, keep_last=2)
    best = str(tmp_path / "coci" / step_dir_name(12))
    assert not (tmp_path / "coci" / step_dir_name(8)).exists()
    assert trainer.checkpoint_callback.best_model_path == best
    trainer.validate(ckpt_path="best")
    assert trainer.ckpt_path == best


def test_best_without_a_monitor_and_nothing_kept_is_a_clear_error(tmp_path: Path) -> None:
    pl.seed_everything(3, verbose=False)
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=100, save_on_train_end=False)
    trainer = _trainer(tmp_path, 4, [coci], limit_val_batches=0)
    trainer.fit(_Scripted())
    assert coci.best_model_path == ""
    with pytest.raises(ValueError, match=r"CociCheckpoint has no kept checkpoint") as e:
        trainer.test(ckpt_path="best")
    assert "newest kept checkpoint" in str(e.value)

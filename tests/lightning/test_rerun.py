"""A script rerun into its default folder (issue 42): the second run says, in one line, that
the folder holds another run, that this one is new and saves beside it (``-v1``), and how to
continue that run instead; a run that resumes says which step it restored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from coci_core import CheckpointManager, ConfigError
from coci_core.engine.format.manifest import step_dir_name
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel
from tests.lightning.test_usual_script import _trainer


def _script(root: Path, **coci: object) -> None:
    """The quick start as a newcomer reruns it: the same default_root_dir every time."""
    pl.seed_everything(3, verbose=False)
    callback = CociCheckpoint(every_n_train_steps=2, keep_last=None, preemption=None, **coci)
    _trainer(root, 4, [callback], limit_val_batches=0).fit(DigitsModel())


def test_a_rerun_into_the_default_folder_says_what_it_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _script(tmp_path)
    caplog.clear()
    with caplog.at_level("INFO"):
        _script(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "another run" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    (line,) = lines
    assert "\n" not in line
    assert f"{tmp_path / 'coci'} holds 2 checkpoint(s) of another run (steps 2, 4)" in line
    assert "This is a new run, not a resumed one" in line and "step-...-v1" in line
    assert (
        'To continue that run instead, fit(ckpt_path="last") or CociCheckpoint(resume=True)' in line
    )
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.latest() == step_dir_name(4, 1)  # the second run's final save, beside
    caplog.clear()
    with caplog.at_level("INFO"):
        _script(tmp_path, resume=True)
    assert "another run" not in caplog.text
    assert f"coci: Lightning restores step 4 from {tmp_path / 'coci'}" in caplog.text


class _WithSGD(DigitsModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)


def test_a_resume_with_another_optimizer_is_refused_by_name(tmp_path: Path) -> None:
    """The module changed from Adam to SGD, resumed from the Adam run's step: a ConfigError
    naming both sides' settings and what to do, before any step; it was torch's
    ``KeyError: 'momentum'`` at the first step, after Lightning had loaded the state."""
    _script(tmp_path)  # Adam, steps 2 and 4
    callback = CociCheckpoint(resume=True, every_n_train_steps=2, preemption=None)
    trainer = _trainer(tmp_path, 6, [callback], limit_val_batches=0)
    module = _WithSGD()
    with pytest.raises(ConfigError, match=r"this run's optimizer \(SGD\).*lacks .*momentum"):
        trainer.fit(module)
    assert module.seen == []


def test_a_resume_with_another_policy_goes_on(tmp_path: Path) -> None:
    """The first run with ``every_n_train_steps=2``, the rerun with coci's own plan (as the
    plan line advises: "leave policy out for coci to plan from the measured costs"): the
    resume failed with ``'state' policy must be 'coci': 'every_n_steps'``."""
    _script(tmp_path)  # steps 2 and 4
    module = DigitsModel()
    callback = CociCheckpoint(resume=True, preemption=None)
    _trainer(tmp_path, 6, [callback], limit_val_batches=0).fit(module)
    assert len(module.seen) == 2 * 16  # steps 5 and 6, from step 4
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4, 6]

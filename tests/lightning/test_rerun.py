"""A script rerun into its default folder (issue 42): the second run says, in one line, that
the folder holds another run, that this one is new and saves beside it (``-v1``), and how to
continue that run instead; a run that resumes says which step it restored."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from coci_core import CheckpointManager
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

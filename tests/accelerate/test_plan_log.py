"""One main-process log line at the first step tells the user the plan."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from coci_accelerate import CociCheckpointer
from coci_core import ConfigError
from tests.accelerate.example import dataset


def _plan_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture, **options: Any) -> list[str]:
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Linear(8, 3)
    model, optimizer, loader = accelerator.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(dataset(), batch_size=8, shuffle=True),  # 12 batches
    )
    ckpt = CociCheckpointer(accelerator, save_on_close=False, **options)
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        try:
            for step, (x, y, _) in enumerate(loader):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                ckpt.step(loss=1.0)
                if step == 5:
                    break
        finally:
            ckpt.close()
    return [r.getMessage() for r in caplog.records if "coci: plan" in r.getMessage()]


def test_plan_from_the_loaders_length(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """num_epochs=3 with 12 batches an epoch: 36 steps; one line, at step 1, with the first
    save, the interval and how to change it: a fixed interval, which no MTBF moves."""
    (line,) = _plan_lines(tmp_path, caplog, policy="every_n_steps", every_n_steps=4, num_epochs=3)
    assert "plan at step 1" in line
    assert "(every_n_steps policy, time objective)" in line
    assert "of 36 steps (len(dataloader) 12 x num_epochs 3)" in line
    assert "first save at step 4" in line and "then every 4 steps" in line
    assert "s assumed" not in line and "mtbf_s=" not in line
    assert "a fixed interval: the MTBF and the measured costs do not change it" in line
    assert "CociCheckpointer(every_n_steps=N)" in line


def test_plan_with_given_total_and_mtbf(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """total_steps and mtbf_s given: the line says so."""
    (line,) = _plan_lines(tmp_path, caplog, total_steps=100, mtbf_s=3600.0)
    assert "of 100 steps (given as total_steps)" in line
    assert "MTBF assumed 3600 s (given as mtbf_s)" in line
    assert "mtbf_s=" in line  # how to change it


def test_num_epochs_needs_a_prepared_loader(tmp_path: Path) -> None:
    """num_epochs before the loader is prepared, or with total_steps, is refused."""
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    with pytest.raises(ConfigError, match="'num_epochs' needs a prepared data loader"):
        CociCheckpointer(accelerator, num_epochs=2)
    with pytest.raises(ConfigError, match="not both"):
        CociCheckpointer(accelerator, num_epochs=2, total_steps=10)


def test_a_step_past_the_total_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that runs past the total it planned over (a resumed loop over epochs that starts
    again at epoch 0 trains again what the checkpoint holds, with no error) is told once, at
    the first step past it, how to start the loop."""
    _plan_lines(tmp_path, caplog, total_steps=3)  # the loop takes 6 steps
    past = [r for r in caplog.records if "past the run's" in r.getMessage()]
    assert len(past) == 1 and past[0].levelno == logging.WARNING
    assert past[0].getMessage().startswith("coci: step 4 is past the run's 3 total steps")
    assert "start it at ckpt.resume() // len(dataloader)" in past[0].getMessage()
    caplog.clear()
    _plan_lines(tmp_path / "within", caplog, total_steps=6)
    assert not [r for r in caplog.records if "past the run's" in r.getMessage()]

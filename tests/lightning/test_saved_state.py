"""What a Lightning save stores is the state at that step: a model with BatchNorm (whose
running statistics the next forward pass changes) and Adam, saved at every step with the
default settings and with ``block=False``, and a model whose EMA of the weights is updated
through ``.data`` right after each save; each checkpoint compared with a copy taken at the
save."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from coci_core import CheckpointManager
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel


class BatchNormDigits(DigitsModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 512),
            torch.nn.BatchNorm1d(512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )


class Recorder(pl.Callback):
    """A copy of the module's state at each step's end, before coci's save (checkpoint
    callbacks run after the others)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *a: Any) -> None:
        self.states[trainer.global_step] = copy.deepcopy(module.state_dict())


class EmaDigits(BatchNormDigits):
    """With an exponential moving average of the weights, updated through ``.data`` (as EMA
    code often does) in the module's ``on_train_batch_end``: after the callbacks' hooks, so
    right after coci's save."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for average, weight in zip(self.ema.parameters(), self.net.parameters(), strict=True):
            average.data.mul_(0.9).add_(weight.data, alpha=0.1)


def _fit_and_compare(tmp_path: Path, model: pl.LightningModule, **options: Any) -> None:
    recorder = Recorder()
    ckpt = CociCheckpoint(
        tmp_path / "c", policy="every_n_steps", every_n_steps=1, keep_last=None, **options
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=24,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, ckpt],
    )
    trainer.fit(model)
    with CheckpointManager(tmp_path / "c") as mgr:
        steps = mgr.steps()
        assert len(steps) >= 20
        for step in steps:
            saved = mgr.restore(step)["state_dict"]
            expected = recorder.states[step]
            assert saved.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(saved[key], value), (step, key)


@pytest.mark.parametrize("block", [True, False])
def test_every_checkpoint_holds_the_state_of_its_step(tmp_path: Path, block: bool) -> None:
    pl.seed_everything(0, verbose=False)
    _fit_and_compare(tmp_path, BatchNormDigits(), block=block)


def test_an_ema_through_data_right_after_the_save_is_not_in_the_checkpoint(
    tmp_path: Path,
) -> None:
    """The default copies the state before the save returns: a write that no version counter
    records (``.data``) cannot reach the checkpoint."""
    pl.seed_everything(0, verbose=False)
    model = EmaDigits()
    _fit_and_compare(tmp_path, model)
    assert not torch.equal(next(model.ema.parameters()), next(model.net.parameters()))  # it ran

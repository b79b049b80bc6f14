"""What a Lightning save stores is the state at that step: a model with BatchNorm (whose
running statistics the next forward pass changes) and Adam, saved at every step with the
default ``block=False``, each checkpoint compared with a copy taken at the save."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
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


def test_every_checkpoint_holds_the_state_of_its_step(tmp_path: Path) -> None:
    recorder = Recorder()
    ckpt = CociCheckpoint(tmp_path / "c", policy="every_n_steps", every_n_steps=1, keep_last=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=24,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, ckpt],
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(BatchNormDigits())
    with CheckpointManager(tmp_path / "c") as mgr:
        steps = mgr.steps()
        assert len(steps) >= 20
        for step in steps:
            saved = mgr.restore(step)["state_dict"]
            expected = recorder.states[step]
            assert saved.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(saved[key], value), (step, key)

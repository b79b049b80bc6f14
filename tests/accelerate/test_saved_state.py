"""What an Accelerate save stores is the state at that step: a model with BatchNorm (whose
running statistics the next forward pass changes) and Adam, saved at every step in a loop
written as Accelerate's examples write it, with the default settings and with
``block=False``, and with an EMA of the weights updated through ``.data`` right after each
``ckpt.step()``; each checkpoint compared with a copy taken when ``ckpt.step()`` saved it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager


class EmaModel(torch.nn.Module):
    """A BatchNorm MLP and an exponential moving average of its weights (not trained)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 512),
            torch.nn.BatchNorm1d(512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )
        self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def update_ema(self) -> None:
        """Through ``.data``, as EMA code often does: no version counter records it."""
        for average, weight in zip(self.ema.parameters(), self.net.parameters(), strict=True):
            average.data.mul_(0.9).add_(weight.data, alpha=0.1)


def _train_and_compare(tmp_path: Path, *, ema: bool, **options: Any) -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    model = EmaModel()
    optimizer = torch.optim.Adam(model.net.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt = CociCheckpointer(
        accelerator,
        policy="every_n_steps",
        every_n_steps=1,
        keep_last=None,
        save_on_close=False,
        **options,
    )
    expected = {}
    for step, (x, y) in enumerate(loader, start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = (
            copy.deepcopy(model.state_dict()),
            copy.deepcopy(optimizer.optimizer.state_dict()["state"]),
        )
        ckpt.step(loss=float(loss.detach()))  # saves this step; the next forward follows at once
        if ema:
            accelerator.unwrap_model(model).update_ema()
    ckpt.close()
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        steps = mgr.steps()
        assert steps == list(range(1, 17))
        for step in steps:
            saved = mgr.restore(step)
            weights, moments = expected[step]
            for key, value in weights.items():
                assert torch.equal(saved["models"][0][key], value), (step, key)
            for i, state in moments.items():
                for key, value in state.items():
                    assert torch.equal(saved["optimizers"][0]["state"][i][key], value), (step, i)


@pytest.mark.parametrize("block", [True, False])
def test_every_checkpoint_holds_the_state_of_its_step(tmp_path: Path, block: bool) -> None:
    _train_and_compare(tmp_path, ema=False, block=block)


def test_an_ema_through_data_right_after_the_save_is_not_in_the_checkpoint(
    tmp_path: Path,
) -> None:
    """The default copies the state before ``ckpt.step()`` returns: a write that no version
    counter records (``.data``) cannot reach the checkpoint."""
    _train_and_compare(tmp_path, ema=True)

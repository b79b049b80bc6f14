"""What an Accelerate save stores is the state at that step: a model with BatchNorm (whose
running statistics the next forward pass changes) and Adam, saved at every step with the
default ``block=False`` in a loop written as Accelerate's examples write it, each checkpoint
compared with a copy taken when ``ckpt.step()`` saved it."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager


def test_every_checkpoint_holds_the_state_of_its_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.BatchNorm1d(512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt = CociCheckpointer(
        accelerator, policy="every_n_steps", every_n_steps=1, keep_last=None, save_on_close=False
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

"""Coci's save and resume run the model pre-hooks that save_state and
load_state run (register_save_state_pre_hook / register_load_state_pre_hook)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, set_seed

from coci_accelerate import CociCheckpointer


def _accelerator(tmp_path: Path) -> Accelerator:
    return Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


def _two_models(accelerator: Accelerator) -> tuple[Any, Any, Any]:
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    return accelerator.prepare(first, second, optimizer)


def test_save_and_load_pre_hooks_run(tmp_path: Path) -> None:
    """The save hook gets the models, the state dicts to save and coci's directory; what it
    changes is what is saved (a bias set to 5) and what it removes is not saved (the second
    model). The load hook gets the models and the directory; the models it removes are not
    loaded (the second model keeps its fresh weights)."""
    set_seed(0)
    accelerator = _accelerator(tmp_path)
    first, second, optimizer = _two_models(accelerator)
    saves: list[tuple[int, int, str]] = []

    def save_hook(models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        saves.append((len(models), len(weights), output_dir))
        weights[0] = {**weights[0], "bias": torch.full((2,), 5.0)}
        weights.pop()  # the second model: saved by the hook itself, say

    accelerator.register_save_state_pre_hook(save_hook)
    ckpt = CociCheckpointer(accelerator, save_on_close=False)
    accelerator.backward(second(first(torch.ones(1, 3))).sum())
    optimizer.step()
    ckpt.step()
    ckpt.save()
    ckpt.close()
    assert saves == [(2, 2, str(tmp_path / "coci"))]
    trained_weight = first.weight.detach().clone()

    AcceleratorState._reset_state(True)
    set_seed(1)
    accelerator = _accelerator(tmp_path)
    first, second, optimizer = _two_models(accelerator)
    fresh_second = {k: v.clone() for k, v in second.state_dict().items()}
    loads: list[tuple[int, str]] = []

    def load_hook(models: list[Any], input_dir: str) -> None:
        loads.append((len(models), input_dir))
        models.pop()

    accelerator.register_load_state_pre_hook(load_hook)
    ckpt = CociCheckpointer(accelerator)
    try:
        assert ckpt.resume() == 1
    finally:
        ckpt.close()
    assert loads == [(2, str(tmp_path / "coci"))]
    assert torch.equal(first.bias.detach(), torch.full((2,), 5.0))
    assert torch.equal(first.weight.detach(), trained_weight)
    for name, value in second.state_dict().items():
        assert torch.equal(value, fresh_second[name])

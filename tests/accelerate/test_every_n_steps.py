"""policy="every_n_steps" saves at exactly the multiples of N, from the first one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager
from coci_core.planner import EveryNSteps
from tests.accelerate.loop import digits


@pytest.mark.parametrize(
    "policy",
    [{"policy": "every_n_steps", "every_n_steps": 3}, {"policy": EveryNSteps(every_n_steps=3)}],
    ids=["name", "object"],
)
@pytest.mark.parametrize(("steps", "total"), [(10, None), (9, 9)])
def test_every_3_steps_saves_at_3_6_9(
    tmp_path: Path, steps: int, total: int | None, policy: dict[str, object]
) -> None:
    """N=3 with a real Accelerator, given by name or as a policy object: saves at 3, 6 and 9
    (9 also as the run's last step), each holding the weights after that many optimizer
    steps."""
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = CociCheckpointer(
        accelerator,
        total_steps=total,
        save_on_close=False,
        **policy,  # type: ignore[arg-type]
    )
    weights = {}
    for step in range(1, steps + 1):
        accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step()
        weights[step] = model.weight.detach().clone()
    ckpt.close()
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 6, 9]
        restored = {s: mgr.restore(s) for s in (3, 6, 9)}
    for step, state in restored.items():
        assert state["completed_steps"] == step
        assert torch.equal(state["models"][0]["weight"], weights[step])


class _Stop(Exception):
    pass


def _accumulating_loop(directory: Path, *, stop_at: int | None = None) -> dict[str, Any]:
    """Two epochs of 64 batches of 8 digits, gradient_accumulation_steps=2 (32 optimizer steps an
    epoch), an epoch-interval LR schedule, every_n_steps=16; resumed from the newest checkpoint;
    ``stop_at``: raise after that many optimizer steps (a crash: no final save)."""
    AcceleratorState._reset_state(True)
    set_seed(5)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(directory),
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(digits(512), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=16, keep_last=None)
    start = ckpt.resume()
    try:
        while ckpt.completed_steps < 64:
            for x, y, _ in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                ckpt.step()
                if ckpt.completed_steps == stop_at:
                    raise _Stop
                if ckpt.completed_steps >= 64:
                    break
    finally:
        ckpt.close()
    weights = accelerator.unwrap_model(model).state_dict()
    return {"start": start, "weights": {k: v.clone() for k, v in weights.items()}}


def test_every_16_optimizer_steps_with_accumulation_across_epochs_and_a_resume(
    tmp_path: Path,
) -> None:
    """The core rule of a fixed interval with Accelerate: with gradient accumulation (a step is two
    batches) over two epochs, saves at 16, 32 (the first epoch's end), 48 and 64, each holding
    that many optimizer steps; a loop stopped at step 40 resumes from 32 and saves on at 48
    and 64, ending with the weights of the uninterrupted loop."""
    reference = _accumulating_loop(tmp_path / "ref")
    expected = [16, 32, 48, 64]
    with CheckpointManager(tmp_path / "ref" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == expected
        assert [mgr.restore(s)["completed_steps"] for s in expected] == expected
    with pytest.raises(_Stop):
        _accumulating_loop(tmp_path / "run", stop_at=40)
    assert CheckpointManager(tmp_path / "run" / "coci", keep_last=None).steps() == [16, 32]
    resumed = _accumulating_loop(tmp_path / "run")
    assert resumed["start"] == 32
    assert CheckpointManager(tmp_path / "run" / "coci", keep_last=None).steps() == expected
    for name, tensor in reference["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name

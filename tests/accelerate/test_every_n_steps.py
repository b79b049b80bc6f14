"""Issue 15: policy="every_n_steps" saves at exactly the multiples of N, from the first one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager
from coci_core.planner import EveryNSteps


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

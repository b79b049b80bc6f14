"""CociCheckpointer with a remote tier: a new node resumes from it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager


def _run(root: Path, remote: Path, steps: int) -> tuple[int, torch.nn.Linear]:
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(root),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = CociCheckpointer(
        accelerator, policy="every_n_steps", every_n_steps=3, remote=str(remote)
    )
    start = ckpt.resume()
    for step in range(start + 1, steps + 1):
        x = torch.full((4, 32), float(step))
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step(step)
    ckpt.close()
    AcceleratorState._reset_state(reset_partial_state=True)
    return start, model


def test_a_new_node_resumes_from_the_remote_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps 3 and 6 reach the remote tier; on a node without the local directory,
    ``resume()`` returns 6 from the remote (the log line names it, not the empty local
    directory) and the run ends where an uninterrupted one does."""
    remote = tmp_path / "remote"
    _run(tmp_path / "node1", remote, 6)
    assert CheckpointManager(remote, keep_last=None).steps() == [3, 6]
    shutil.rmtree(tmp_path / "node1")
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        start, resumed = _run(tmp_path / "node2", remote, 9)
    assert start == 6
    assert f"coci: Accelerate restores step 6 from {remote} (the remote tier)" in caplog.text
    _, reference = _run(tmp_path / "reference", tmp_path / "reference-remote", 9)
    assert torch.equal(resumed.weight, reference.weight)
    assert torch.equal(resumed.bias, reference.bias)

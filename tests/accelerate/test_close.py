"""close() saves the final state by default, with an opt-out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, set_seed

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager


def _run(tmp_path: Path, steps: int, **options: Any) -> tuple[CociCheckpointer, torch.nn.Module]:
    set_seed(3)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=4, **options)
    for _ in range(steps):
        accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step()
    return ckpt, model


def _steps(tmp_path: Path) -> list[int]:
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        return mgr.steps()


def test_close_saves_the_final_state(tmp_path: Path) -> None:
    """10 steps, planned saves at 4 and 8: close() also saves step 10, and a fresh run
    resumes there with the final weights."""
    ckpt, model = _run(tmp_path, 10)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.close()
    assert _steps(tmp_path) == [4, 8, 10]
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    other = torch.nn.Linear(4, 2)
    other, _ = accelerator.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    resumed = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=4)
    assert resumed.resume() == 10
    resumed.close()
    for name, value in other.state_dict().items():
        assert torch.equal(value, final[name])
    assert _steps(tmp_path) == [4, 8, 10]  # nothing new to save: no duplicate


def test_close_opt_out(tmp_path: Path) -> None:
    """close(save=False) and save_on_close=False save only the planned steps."""
    ckpt, _ = _run(tmp_path / "a", 10)
    ckpt.close(save=False)
    assert _steps(tmp_path / "a") == [4, 8]
    AcceleratorState._reset_state(True)
    ckpt, _ = _run(tmp_path / "b", 10, save_on_close=False)
    ckpt.close()
    assert _steps(tmp_path / "b") == [4, 8]


def _crash(ckpt: CociCheckpointer, save: bool | None) -> None:
    try:
        raise RuntimeError("boom")
    finally:
        ckpt.close(save=save)


def test_close_during_an_exception_saves_only_when_forced(tmp_path: Path) -> None:
    """close() in a finally while an exception propagates keeps the last planned save;
    close(save=True) saves anyway."""
    for directory, save, expected in (
        (tmp_path / "a", None, [4, 8]),
        (tmp_path / "b", True, [4, 8, 10]),
    ):
        AcceleratorState._reset_state(True)
        ckpt, _ = _run(directory, 10)
        with pytest.raises(RuntimeError, match="boom"):
            _crash(ckpt, save)
        assert _steps(directory) == expected


def test_a_sigterm_after_the_last_step_stops_the_run_at_close(tmp_path: Path) -> None:
    """A SIGTERM after the last ``ckpt.step()`` (a final evaluation) was dropped at
    ``close()``, and the script went on: ``close()`` saves the final step, waits until it is
    durable, then raises ``Preempted`` (exit status 143)."""
    import os
    import signal

    from coci_core import Preempted

    before = signal.getsignal(signal.SIGTERM)
    ckpt, _ = _run(tmp_path, 6)
    os.kill(os.getpid(), signal.SIGTERM)  # the final evaluation, say
    with pytest.raises(Preempted) as stopped:
        ckpt.close()
    assert stopped.value.code == 143 and stopped.value.step == 6
    assert _steps(tmp_path) == [4, 6]
    assert signal.getsignal(signal.SIGTERM) is before
    AcceleratorState._reset_state(True)


class _Counter:
    """A user's object registered for checkpointing after the CociCheckpointer."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_a_second_checkpointer_on_one_accelerator_resumes_the_first(tmp_path: Path) -> None:
    """Two training loops one after the other on one Accelerator (a notebook), each with its
    CociCheckpointer: the second resumes where the first closed, and the user's object
    registered after the first one gets its own state back (before: "registered objects: 2
    at the save, 3 now (CociCheckpointer, _Counter, CociCheckpointer)", as the closed one
    stayed registered)."""
    ckpt, _ = _run(tmp_path, 6)
    counter = _Counter()
    ckpt.accelerator.register_for_checkpointing(counter)
    counter.n = 6
    ckpt.close()
    counter.n = -1
    second = CociCheckpointer(ckpt.accelerator, policy="every_n_steps", every_n_steps=4)
    assert second.resume() == 6
    assert counter.n == 6
    second.close()
    assert _steps(tmp_path) == [4, 6]

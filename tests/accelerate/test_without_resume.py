"""A run is reproducible whether or not it called resume() before saving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader

from coci_accelerate import CociCheckpointer
from tests.accelerate.example import STEPS_PER_EPOCH, Stop, dataset, digest

EPOCHS = 4


def _run(directory: Path, *, resume: bool, kill_at: int | None = None) -> str:
    """Saves only with ckpt.save() at each epoch's end (never ckpt.step()); ``resume``: call
    ckpt.resume() first. Dropout draws from the global random state."""
    AcceleratorState._reset_state(True)
    set_seed(5)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(directory),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=1000)
    overall_step = ckpt.resume() if resume else 0
    try:
        for _ in range(overall_step // STEPS_PER_EPOCH, EPOCHS):
            for x, y, _idx in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                overall_step += 1
                if overall_step == kill_at:
                    raise Stop
            ckpt.save(overall_step)
    finally:
        ckpt.close(save=False)
    return digest(accelerator.unwrap_model(model))


def test_a_run_that_never_called_resume_is_reproduced(tmp_path: Path) -> None:
    """Run A never calls resume() (nor step()) and is killed in its third epoch; resuming from
    its checkpoint (end of epoch 2) ends bit-identical to A uninterrupted: the loader draws its
    iterators' seeds from its own generator from the start in both, not from the global random
    state that dropout uses."""
    reference = _run(tmp_path / "ref", resume=False)
    with pytest.raises(Stop):
        _run(tmp_path / "run", resume=False, kill_at=2 * STEPS_PER_EPOCH + 5)
    assert _run(tmp_path / "run", resume=True) == reference


def test_a_fresh_run_into_another_runs_directory_warns_and_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second run without resume() into the same directory warns once, saves beside the
    first run's checkpoints without overwriting any, and a resume() then continues it."""
    reference = _run(tmp_path / "ref", resume=False)
    with pytest.raises(Stop):
        _run(tmp_path / "run", resume=False, kill_at=3 * STEPS_PER_EPOCH + 1)
    root = tmp_path / "run"
    coci_dir = next(p.parent.parent for p in root.rglob("manifest.json"))
    first = {p: p.read_bytes() for p in coci_dir.glob("step-*/manifest.json")}
    assert len(first) >= 2
    with caplog.at_level("WARNING", logger="coci_core"), pytest.raises(Stop):
        _run(root, resume=False, kill_at=2 * STEPS_PER_EPOCH + 3)
    assert caplog.text.count("of another run") == 1
    assert "This is a new run, not a resumed one" in caplog.text
    assert "To continue that run instead, call ckpt.resume() before the loop" in caplog.text
    # the ends of epochs 1 and 2, steps the first run holds too: saved beside them
    assert {p.name for p in coci_dir.glob("step-*-v1")} == {
        f"step-{n * STEPS_PER_EPOCH:010d}-v1" for n in (1, 2)
    }
    assert {p: p.read_bytes() for p in first} == first
    assert _run(root, resume=True) == reference

"""The README's plain-loop quick start, copied from the README itself, resumes exactly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _quick_start(title: str) -> str:
    text = README.read_text()
    section = text.split(f"## {title}", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no python block under {title!r}"
    return match.group(1)


def _run(code: str, total: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    namespace: dict[str, Any] = {"model": model, "opt": opt, "total": total}

    def train_one_step() -> None:
        g = torch.Generator().manual_seed(int(namespace["step"]))  # the data of this step
        x = torch.randn(32, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    namespace["train_one_step"] = train_one_step
    exec(compile(code, str(README), "exec"), namespace)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_plain_loop_quick_start_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after 250 of 400 steps (last checkpoint: 200 steps done) and run again, the
    README's loop ends with the weights of an uninterrupted run (it used to train the restored
    step twice)."""
    code = _quick_start("Quick start: any training loop")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    reference = _run(code, 400)
    monkeypatch.chdir(tmp_path / "b")
    _run(code, 250)
    resumed = _run(code, 400)
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key


def test_lightning_quick_start_saves_and_resumes(tmp_path: Path) -> None:
    """The README's Lightning quick start, run as written (the Trainer bounded to 20 steps on
    the digits model): fit saves coci checkpoints, and the second fit resumes from the newest
    one instead of training again from scratch."""
    import functools

    import lightning.pytorch as pl

    from coci_core import CheckpointManager
    from tests.lightning.models import DigitsModel

    code = _quick_start("Quick start: Lightning")
    pl.seed_everything(1, verbose=False)
    model = DigitsModel()
    trainer_factory = functools.partial(
        pl.Trainer,
        accelerator="cpu",
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    namespace: dict[str, Any] = {"Trainer": trainer_factory, "model": model}
    exec(compile(code, str(README), "exec"), namespace)
    trainer = namespace["trainer"]
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.latest_step() == 20  # the final save of the first fit
    # the second fit resumed at step 20 (max_steps): it trained no further step
    assert trainer.global_step == 20
    assert len(model.seen) == 20 * 16

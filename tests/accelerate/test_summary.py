"""CociCheckpointer(verbose=True) logs a line per save; close() logs one summary."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

from coci_accelerate import CociCheckpointer
from coci_core import ConfigError


def _accelerator(tmp_path: Path) -> Accelerator:
    return Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_lines_and_one_summary_at_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, verbose: bool
) -> None:
    """10 steps, saves at 4 and 8 and the final one at close(): with verbose a line for each
    (step, stall in ms, MB written, durable); always one summary line, even if close() is
    called twice."""
    set_seed(3)
    accelerator = _accelerator(tmp_path)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=4, verbose=verbose)
    with caplog.at_level(logging.INFO):
        for _ in range(10):
            accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step()
        ckpt.close()
        ckpt.close()
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    per_save = [
        m for name, m in messages if name == "coci_accelerate.checkpointer" and " saved: " in m
    ]
    assert [m for _, m in messages if "saved step" in m] == []  # each save told once
    if verbose:
        assert [m.split(" saved")[0] for m in per_save] == [
            "coci: step 4",
            "coci: step 8",
            "coci: step 10",
        ]
        assert all(" ms, " in m and " MB written" in m and "durable" in m for m in per_save)
    else:
        assert per_save == []
    summary = [
        m for name, m in messages if name == "coci_accelerate.checkpointer" and "committed" in m
    ]
    assert len(summary) == 1
    assert summary[0].startswith("coci: 3 checkpoints committed (newest step 10), total stall ")
    assert summary[0].endswith(" MB written")


def test_verbose_is_checked(tmp_path: Path) -> None:
    accelerator = _accelerator(tmp_path)
    model = torch.nn.Linear(4, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="'verbose' must be a bool"):
        CociCheckpointer(accelerator, verbose=1)  # type: ignore[arg-type]


def test_a_finished_run_requeued_says_it_had_nothing_left_to_train(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run resumed at its final checkpoint (a scheduler requeued it after it finished, as a
    late SIGTERM's exit status 143 asks) says so, not "no checkpoint committed", which reads
    as saves that all went wrong."""

    def run(steps: int) -> list[str]:
        set_seed(3)
        accelerator = _accelerator(tmp_path)
        model = torch.nn.Linear(4, 2)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        ckpt = CociCheckpointer(accelerator, total_steps=4)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            done = ckpt.resume()
            for _ in range(done, steps):
                accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
                ckpt.step()
            ckpt.close()
        name = "coci_accelerate.checkpointer"
        return [
            r.getMessage() for r in caplog.records if r.name == name and "step" in r.getMessage()
        ]

    assert any("1 checkpoint committed (newest step 4)" in m for m in run(4))
    assert "coci: resumed at step 4, the newest checkpoint; no step to train after it" in run(4)


def test_a_crash_after_the_resume_is_not_told_as_a_finished_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that raises in its first step after ckpt.resume(), with ckpt.close() in a
    finally: the summary line says nothing was committed, not "resumed at step 4, the newest
    checkpoint; no step to train after it" (a run with steps left that crashed)."""

    def run(steps: int, crash: bool) -> list[str]:
        set_seed(3)
        accelerator = _accelerator(tmp_path)
        model = torch.nn.Linear(4, 2)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        ckpt = CociCheckpointer(accelerator, total_steps=8)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            try:
                done = ckpt.resume()
                for _ in range(done, steps):
                    if crash:
                        raise RuntimeError("a data error")
                    accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
                    ckpt.step()
            finally:
                ckpt.close()
        name = "coci_accelerate.checkpointer"
        return [r.getMessage() for r in caplog.records if r.name == name]

    run(4, crash=False)
    with pytest.raises(RuntimeError, match="a data error"):
        run(8, crash=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "coci_accelerate.checkpointer"]
    assert not any("no step to train after it" in m for m in lines)
    assert any(m.startswith("coci: no checkpoint committed") for m in lines)

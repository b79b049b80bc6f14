"""The step is the number of optimizer steps completed, as in Accelerate's
checkpointing example; a script written that way resumes bit-identical."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager, ConfigError
from tests.accelerate.example import BATCH, STEPS_PER_EPOCH, Stop, train_like_example
from tests.accelerate.test_accelerate import _kill_and_resume
from tests.harness.processes import module


def _fresh() -> None:
    AcceleratorState._reset_state(True)


def test_example_shaped_loop_resumes_bit_identical(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed at step 17 (5 batches into epoch 2), resumed in a fresh Accelerator: resume()
    returns 16, the checkpoint's label; the loop skips 4 batches and ends bit-identical, each
    sample of the later epochs in the uninterrupted order (and is not told to skip them)."""
    reference = train_like_example(str(tmp_path / "ref"))
    _fresh()
    with pytest.raises(Stop):
        train_like_example(str(tmp_path / "run"), kill_at=17)
    with CheckpointManager(tmp_path / "run" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [4, 8, 12, 16]
    _fresh()
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        resumed = train_like_example(str(tmp_path / "run"))
    assert "skip_first_batches" not in caplog.text  # the loop skips them already
    assert resumed["start"] == 16
    assert resumed["seen"] == reference["seen"][16 * BATCH :]
    assert resumed["digest"] == reference["digest"]


def test_a_resumed_loop_that_does_not_skip_is_told_to(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Resumed 4 batches into an epoch by a loop that does not skip them: one WARNING at its
    first step says how many to skip and how (it showed at resume, before the loop, and so to
    a loop that skips too)."""
    with pytest.raises(Stop):
        train_like_example(str(tmp_path), kill_at=17)
    _fresh()
    with caplog.at_level(logging.INFO, logger="coci_accelerate"), pytest.raises(Stop):
        train_like_example(str(tmp_path), kill_at=17, skip=False)
    (advice,) = [r for r in caplog.records if "skip_first_batches" in r.getMessage()]
    assert advice.levelno == logging.WARNING
    assert "4 batches into an epoch" in advice.getMessage()
    assert "accelerator.skip_first_batches(dataloader, 4)" in advice.getMessage()


def test_skipping_the_batches_of_a_stateful_loader_after_a_resume_is_told_it_drops_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Accelerate's example skips the resumed epoch's first batches; a stateful loader is
    put back mid-epoch by the resume itself, so the example's skip drops as many again, never
    trained on (the resumed run ended 4 steps short, saying nothing): a WARNING at the call
    names both counts. The loop that iterates the stateful loader itself is told nothing."""
    reference = train_like_example(str(tmp_path / "ref"), stateful=True)
    _fresh()
    with pytest.raises(Stop):
        train_like_example(str(tmp_path / "run"), kill_at=17, stateful=True)
    _fresh()
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        skipped = train_like_example(str(tmp_path / "run"), stateful=True)
    assert skipped["start"] == 16
    assert len(skipped["seen"]) == len(reference["seen"][16 * BATCH :]) - 4 * BATCH
    (told,) = [r for r in caplog.records if "skip_first_batches(dataloader, 4)" in r.getMessage()]
    assert told.levelno == logging.WARNING
    assert told.getMessage().startswith(
        "coci: accelerator.skip_first_batches(dataloader, 4) of a loader with "
        "use_stateful_dataloader=True, which ckpt.resume() put back 4 batches into its epoch:"
    )
    assert "the skip drops 4 more batches of this epoch, never trained on" in told.getMessage()
    _fresh()
    with pytest.raises(Stop):
        train_like_example(str(tmp_path / "own"), kill_at=17, stateful=True)
    _fresh()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        itself = train_like_example(str(tmp_path / "own"), stateful=True, skip=False)
    assert "skip_first_batches" not in caplog.text
    assert itself["seen"] == reference["seen"][16 * BATCH :]
    assert itself["digest"] == reference["digest"]


def test_the_batches_to_skip_count_the_accumulation_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """gradient_accumulation_steps=2, 12 batches an epoch (6 optimizer steps): resumed after 8
    optimizer steps is 2 steps, 4 batches, into the second epoch (it said 8)."""
    from coci_accelerate.checkpointer import _log_skip_advice
    from tests.accelerate.example import dataset

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    loader = accelerator.prepare(torch.utils.data.DataLoader(dataset(), batch_size=BATCH))
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        _log_skip_advice(accelerator, 8, {})
        _log_skip_advice(accelerator, 8, {id(loader): loader})  # skipped: nothing said
    (advice,) = [r.getMessage() for r in caplog.records]
    assert "after 8 optimizer steps, 4 batches into" in advice
    assert "skip_first_batches(dataloader, 4)" in advice


def test_chained_resumes_with_implicit_step(tmp_path: Path) -> None:
    """ckpt.step() with no argument; killed at 17 and again at 27, after a save on the last
    batch of the epoch that skip_first_batches ran: still bit-identical."""
    reference = train_like_example(str(tmp_path / "ref"), epochs=4, explicit=False)
    run = str(tmp_path / "run")
    for kill in (17, 27):
        _fresh()
        with pytest.raises(Stop):
            train_like_example(run, epochs=4, explicit=False, kill_at=kill, every_n_steps=8)
    _fresh()
    resumed = train_like_example(run, epochs=4, explicit=False, every_n_steps=8)
    assert resumed["start"] == 2 * STEPS_PER_EPOCH
    assert resumed["seen"] == reference["seen"][2 * STEPS_PER_EPOCH * BATCH :]
    assert resumed["digest"] == reference["digest"]


def test_a_step_of_another_convention_is_refused_at_once(tmp_path: Path) -> None:
    """ckpt.step(n) with n not the count of optimizer steps completed (the 0-based index of
    the step just taken, say) raises ConfigError at the first call, naming the convention."""
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = CociCheckpointer(accelerator)
    try:
        accelerator.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        with pytest.raises(ConfigError, match=r"optimizer steps completed so far, 1 here"):
            ckpt.step(0)
        assert ckpt.step(1) is None
        assert ckpt.completed_steps == 1
    finally:
        ckpt.close()


@pytest.mark.slow
@pytest.mark.faults
def test_example_shaped_script_survives_sigkill(tmp_path: Path) -> None:
    """The same script as a process, SIGKILLed after step 17 (its save at 16 may still be
    in flight): a new process resumes from the newest committed step and ends bit-identical."""
    command = module("tests.accelerate.example")
    reference = train_like_example(str(tmp_path / "ref"))
    steps, resumed = _kill_and_resume(command, tmp_path / "run", 3, 17)
    assert steps and steps[-1] <= 17 and steps[-1] % 4 == 0  # older if the writer lagged
    assert resumed[0]["start"] == steps[-1]
    assert resumed[0]["seen"] == reference["seen"][steps[-1] * BATCH :]
    assert resumed[0]["digest"] == reference["digest"]


def test_gradient_accumulation_counts_optimizer_updates(tmp_path: Path) -> None:
    """With gradient_accumulation_steps=2 and ckpt.step() after every batch, the count is
    the updates made (half the batches); saves are labelled with it and land on updates."""
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = CociCheckpointer(
        accelerator, policy="every_n_steps", every_n_steps=4, save_on_close=False
    )
    try:
        for _ in range(16):
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.ones(1, 2)).sum())
                optimizer.step()
                optimizer.zero_grad()
            ckpt.step()
        assert ckpt.completed_steps == 8
    finally:
        ckpt.close()
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [4, 8]


def test_load_state_of_a_folder_saved_before_coci_is_told_why_it_is_refused(
    tmp_path: Path,
) -> None:
    """A script that ran with Accelerate's save_state, then got a CociCheckpointer, calls
    load_state on its old folder: Accelerate refused it with "Registered objects: 2" where the
    script registered one (coci registers itself). A ConfigError says why and what to do; the
    same folder loaded before the checkpointer is made loads."""

    class Counter:
        def __init__(self) -> None:
            self.seen = 0

        def state_dict(self) -> dict[str, int]:
            return {"seen": self.seen}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.seen = state["seen"]

    def prepared() -> tuple[Accelerator, Counter]:
        _fresh()
        accelerator = Accelerator(
            cpu=True,
            project_dir=str(tmp_path),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        )
        counter = Counter()
        accelerator.register_for_checkpointing(counter)
        model = torch.nn.Linear(8, 3)
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return accelerator, counter

    accelerator, counter = prepared()
    counter.seen = 24
    accelerator.save_state(str(tmp_path / "epoch_0"))
    accelerator, counter = prepared()
    ckpt = CociCheckpointer(accelerator, save_on_close=False)
    with pytest.raises(ConfigError) as refused:
        accelerator.load_state(str(tmp_path / "epoch_0"))
    ckpt.close()
    said = str(refused.value)
    assert said.startswith(
        f"accelerator.load_state({str(tmp_path / 'epoch_0')!r}): the folder holds the states "
        "of 1 objects registered with register_for_checkpointing, this Accelerator has 2: the "
        "CociCheckpointer registers itself"
    ), said
    assert "call accelerator.load_state(...) before making the CociCheckpointer" in said
    accelerator, counter = prepared()
    accelerator.load_state(str(tmp_path / "epoch_0"))
    ckpt = CociCheckpointer(accelerator, save_on_close=False)
    assert counter.seen == 24 and ckpt.resume() == 0
    ckpt.close()

"""With gradient accumulation, what coci tells the loop counts optimizer steps, not batches.

``len(dataloader)`` counts batches; with ``gradient_accumulation_steps=N`` an optimizer step takes
N of them (the epoch's last one fewer), so the plan line, the advice on where a resumed loop
starts, the skip advice and the error of a step counted per batch speak of optimizer steps per
epoch and name how they follow from the loader's length.
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from coci_accelerate import CociCheckpointer
from coci_core import ConfigError
from tests.accelerate.example import SAMPLES, dataset

BATCH = 10
ACCUMULATION = 3
BATCHES = math.ceil(SAMPLES / BATCH)  # 10
PER_EPOCH = math.ceil(BATCHES / ACCUMULATION)  # 4: the epoch's last step takes 1 batch


def _prepared(
    tmp_path: Path, *, seedable: bool = True
) -> tuple[Accelerator, object, object, object]:
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        gradient_accumulation_steps=ACCUMULATION,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable),
    )
    model = torch.nn.Linear(8, 3)
    model, optimizer, loader = accelerator.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(dataset(), batch_size=BATCH, shuffle=True),
    )
    assert len(loader) == BATCHES
    return accelerator, model, optimizer, loader


def _train(
    accelerator: Accelerator,
    model: object,
    optimizer: object,
    loader: object,
    ckpt: CociCheckpointer,
    epochs: int,
    *,
    per_batch_count: bool = False,
    stop_at: int | None = None,
) -> None:
    overall_step = 0
    for _ in range(epochs):
        for x, y, _ in loader:  # type: ignore[attr-defined]
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)  # type: ignore[operator]
                accelerator.backward(loss)
                optimizer.step()  # type: ignore[attr-defined]
                optimizer.zero_grad()  # type: ignore[attr-defined]
            if per_batch_count or accelerator.sync_gradients:
                overall_step += 1
            ckpt.step(overall_step, loss=loss.item())
            if overall_step == stop_at:
                return


def test_the_plan_line_counts_optimizer_steps_per_epoch_and_names_the_loaders_batches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """10 batches an epoch with gradient_accumulation_steps=3 are 4 optimizer steps: the line
    said "len(dataloader) 4", where the user's len(dataloader) is 10."""
    accelerator, model, optimizer, loader = _prepared(tmp_path)
    ckpt = CociCheckpointer(accelerator, num_epochs=2, save_on_close=False)
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        _train(accelerator, model, optimizer, loader, ckpt, 1)
    ckpt.close()
    (line,) = [r.getMessage() for r in caplog.records if "coci: plan" in r.getMessage()]
    assert (
        f"of {2 * PER_EPOCH} steps ({PER_EPOCH} optimizer steps per epoch (len(dataloader) "
        f"{BATCHES} with gradient_accumulation_steps {ACCUMULATION}) x num_epochs 2)" in line
    ), line
    assert f"len(dataloader) {PER_EPOCH} " not in line


def test_a_loop_past_its_total_is_told_the_epoch_in_optimizer_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The advice on where a resumed loop starts was ``ckpt.resume() // len(dataloader)``: with
    accumulation that epoch is too early (4 steps an epoch, not 10)."""
    accelerator, model, optimizer, loader = _prepared(tmp_path)
    ckpt = CociCheckpointer(accelerator, num_epochs=1, save_on_close=False)
    with caplog.at_level(logging.INFO, logger="coci_accelerate"):
        _train(accelerator, model, optimizer, loader, ckpt, 2)  # one epoch more than planned
    ckpt.close()
    (past,) = [r.getMessage() for r in caplog.records if "past the run's" in r.getMessage()]
    assert past.startswith(f"coci: step {PER_EPOCH + 1} is past the run's {PER_EPOCH} total")
    assert past.endswith(
        f"start it at ckpt.resume() // {PER_EPOCH} (optimizer steps per epoch: len(dataloader) "
        f"{BATCHES} with gradient_accumulation_steps {ACCUMULATION})"
    ), past


def test_a_step_counted_per_batch_under_accumulation_is_told_to_count_at_sync_gradients(
    tmp_path: Path,
) -> None:
    """``overall_step += 1`` after every ``optimizer.step()``, as the message advised, is a
    count of batches under accumulation: the error says when an optimizer step completes."""
    accelerator, model, optimizer, loader = _prepared(tmp_path)
    ckpt = CociCheckpointer(accelerator, num_epochs=1, save_on_close=False)
    try:
        with pytest.raises(ConfigError) as raised:
            _train(accelerator, model, optimizer, loader, ckpt, 1, per_batch_count=True)
    finally:
        ckpt.close()
    message = str(raised.value)
    assert message.startswith("ckpt.step(1): coci labels a step with the number of optimizer")
    assert (
        f"With gradient_accumulation_steps={ACCUMULATION}, optimizer.step() completes an "
        "optimizer step only once every that many batches, when accelerator.sync_gradients is "
        "True: count then (if accelerator.sync_gradients: overall_step += 1)" in message
    ), message


def test_the_seedable_sampler_warning_counts_the_batches_to_skip_with_accumulation(
    tmp_path: Path,
) -> None:
    """The warning's skip advice, ``ckpt.resume() % len(dataloader)``, counted optimizer steps
    as batches; with accumulation it gives the expression of the batches."""
    accelerator, *_ = _prepared(tmp_path, seedable=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = CociCheckpointer(accelerator, num_epochs=1, save_on_close=False)
    ckpt.close()
    (said,) = [str(w.message) for w in caught if "use_seedable_sampler" in str(w.message)]
    expression = f"ckpt.resume() % math.ceil(len(dataloader) / {ACCUMULATION}) * {ACCUMULATION}"
    assert f"accelerator.skip_first_batches(dataloader, {expression}, " in said, said
    resumed = 2 * PER_EPOCH + 2  # two epochs and 2 optimizer steps: 6 batches of the third
    assert (
        eval(expression, {"math": math}, {"ckpt": _Resumed(resumed), "dataloader": range(BATCHES)})
        == 6
    )


class _Resumed:
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def resume(self) -> int:
        return self.steps


def test_a_skip_of_other_than_the_resumed_epochs_batches_is_told_the_right_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved after 5 optimizer steps (4 an epoch, the last of 1 batch): 1 step, 3 batches, into
    the second epoch. A count of batches taken as ``ckpt.resume() % len(dataloader)`` (5)
    drops 2 batches untrained, silently: a WARNING at the call says so and gives 3; a count
    too small is told it trains batches again; the right count is told nothing."""
    accelerator, model, optimizer, loader = _prepared(tmp_path)
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=5)
    _train(accelerator, model, optimizer, loader, ckpt, 2, stop_at=5)
    ckpt.close(save=False)
    said: dict[int, list[str]] = {}
    for batches in (5, 1, 3):
        AcceleratorState._reset_state(True)
        accelerator, model, optimizer, loader = _prepared(tmp_path)
        ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=5)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="coci_accelerate"):
            assert ckpt.resume() == 5
            accelerator.skip_first_batches(loader, batches)
        ckpt.close(save=False)
        said[batches] = [
            r.getMessage()
            for r in caplog.records
            if "skip_first_batches(dataloader, " in r.getMessage()
        ]
    (dropped,) = said[5]
    assert dropped == (
        "coci: accelerator.skip_first_batches(dataloader, 5), but ckpt.resume() restored a "
        f"step 3 batches into this epoch (5 optimizer steps with "
        f"gradient_accumulation_steps {ACCUMULATION}, {BATCHES} batches an epoch): 2 batches of "
        "this epoch are never trained on; skip 3"
    )
    (again,) = said[1]
    assert "the resumed epoch trains 2 of them again; skip 3" in again
    assert said[3] == []

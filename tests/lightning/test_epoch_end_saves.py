"""A fixed interval saves at exactly the multiples of N of ``global_step``, where
``ModelCheckpoint(every_n_train_steps=N)`` saves, also at an epoch's last step, and a resume from
such a checkpoint ends bit-identical to the uninterrupted run (see coci_lightning/_epoch_end.py)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from coci_core import CheckpointManager, Preempted
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel, IndexedDigits, digest

pytestmark = pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")

SAMPLES = 256


class _EpochModel(DigitsModel):
    """DigitsModel (dropout, epoch-interval StepLR, shuffling stateful loader) that also logs an
    epoch mean, records its epoch hooks and, with ``validate``, validates at each epoch's end."""

    def __init__(self, batch_size: int = 16, validate: bool = False) -> None:
        super().__init__(batch_size=batch_size)
        self.validate = validate
        self.events: list[tuple[str, int, int]] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        self.log("loss_mean", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_start(self) -> None:
        self.events.append(("epoch_start", self.trainer.global_step, self.trainer.current_epoch))

    def on_train_epoch_end(self) -> None:
        self.events.append(("epoch_end", self.trainer.global_step, self.trainer.current_epoch))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def on_validation_epoch_end(self) -> None:
        self.events.append(("validation", self.trainer.global_step, self.trainer.current_epoch))

    def val_dataloader(self) -> Any:
        return StatefulDataLoader(IndexedDigits(32), batch_size=16)


def _fit(
    root: Path,
    callbacks: list[pl.Callback],
    *,
    seed: int = 1,
    validate: bool = False,
    batch_size: int = 16,
    ckpt_path: str | None = None,
    **trainer_options: Any,
) -> tuple[_EpochModel, pl.Trainer]:
    pl.seed_everything(seed, verbose=False)
    model = _EpochModel(batch_size=batch_size, validate=validate)
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 1.0 if model.validate else 0,
        **trainer_options,
    }
    trainer = pl.Trainer(callbacks=callbacks, **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _model_checkpoint_steps(directory: Path) -> list[int]:
    return sorted(int(re.search(r"step=(\d+)", p.name)[1]) for p in directory.glob("*.ckpt"))  # type: ignore[index]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_n_steps_saves_where_model_checkpoint_does(tmp_path: Path, accumulate: int) -> None:
    """Two epochs of 64 batches, every 16 optimizer steps, beside
    ModelCheckpoint(every_n_train_steps=16) in the same Trainer: the same steps, the multiples of
    16, the epoch's last step included (and with accumulate_grad_batches=2, where a step is
    two batches), the final one being the end-of-fit save."""
    steps = 2 * (SAMPLES // 4) // accumulate
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=16, keep_last=None)
    reference = ModelCheckpoint(
        dirpath=tmp_path / "mc", every_n_train_steps=16, save_top_k=-1, filename="{step}"
    )
    _fit(
        tmp_path,
        [coci, reference],
        batch_size=4,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
    )
    expected = list(range(16, steps + 1, 16))
    assert _model_checkpoint_steps(tmp_path / "mc") == expected
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == expected
        saved = [mgr.restore(s) for s in expected]
    # each holds the state after that step's batches (not one batch of the next step)
    assert [s["global_step"] for s in saved] == expected
    batches = [
        s["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] for s in saved
    ]
    assert batches == [step * accumulate for step in expected]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Any, ...]]:
    """40 steps (2.5 epochs of 16) without checkpoints, without and with validation."""
    runs = {}
    for validate in (False, True):
        runs[validate] = _fit(tmp_path_factory.mktemp("ref"), [], validate=validate, max_steps=40)
    return runs


def _same_run(
    resumed: tuple[_EpochModel, pl.Trainer], reference: tuple[_EpochModel, pl.Trainer], start: int
) -> None:
    """The resumed run ends where the uninterrupted one does, having done what it did after
    step ``start``: weights, samples, epochs, hooks, learning rate, logger step count."""
    (model, trainer), (ref_model, ref_trainer) = resumed, reference
    assert digest(model) == digest(ref_model)
    assert model.seen == ref_model.seen[start * 16 :]
    events = ref_model.events
    assert model.events == events[events.index(("epoch_end", start, start // 16 - 1)) :]
    assert trainer.current_epoch == ref_trainer.current_epoch
    lr = [t.optimizers[0].param_groups[0]["lr"] for t in (trainer, ref_trainer)]
    assert lr[0] == lr[1]
    loops = (trainer.fit_loop.epoch_loop, ref_trainer.fit_loop.epoch_loop)
    assert loops[0]._batches_that_stepped == loops[1]._batches_that_stepped


@pytest.mark.parametrize("validate", [False, True], ids=["no_validation", "validation"])
def test_a_save_at_an_epochs_last_step_resumes_exactly(
    tmp_path: Path, uninterrupted: dict[bool, tuple[Any, ...]], validate: bool
) -> None:
    """every_n_steps=16 with 16 batches an epoch: the run stopped at step 20 saved at 16 (the
    epoch's last step, not 17); the run resumed from it ends bit-identical, having run that
    epoch's end once (its validation before the save, its hooks and LR step after it), and
    saves on at 32 (the multiples, across the resume)."""
    first = CociCheckpoint(policy="every_n_steps", every_n_steps=16, save_on_train_end=False)
    model, _ = _fit(tmp_path, [first], validate=validate, max_steps=20)
    assert CheckpointManager(tmp_path / "coci").steps() == [16]
    assert ("validation", 16, 0) in model.events or not validate
    resumed = _fit(
        tmp_path,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=16, keep_last=None)],
        validate=validate,
        seed=99,  # another seed: the random states come back from the checkpoint
        ckpt_path="last",
        max_steps=40,
    )
    _same_run(resumed, uninterrupted[validate], 16)  # the epoch's end (hooks) once, after it
    assert CheckpointManager(tmp_path / "coci", keep_last=None).steps() == [16, 32, 40]


def test_epoch_end_monitors_see_the_epochs_metrics_after_a_resume(tmp_path: Path) -> None:
    """EarlyStopping checking an epoch mean at the epoch's end: a run resumed from a save at
    the epoch's last step (which trained none of that epoch) does not fail for want of the
    metric; it sees the value the uninterrupted run saw and stops at the same step."""

    def stopper() -> EarlyStopping:
        return EarlyStopping("loss_mean", patience=0, check_on_train_epoch_end=True)

    reference, ref_trainer = _fit(tmp_path / "ref", [stopper()], max_steps=40, max_epochs=3)
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=16, save_on_train_end=False)
    _fit(tmp_path, [coci, stopper()], max_steps=20)
    assert CheckpointManager(tmp_path / "coci").steps() == [16]
    model, trainer = _fit(
        tmp_path,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=16), stopper()],
        seed=99,
        ckpt_path="last",
        max_steps=40,
        max_epochs=3,
    )
    stops = [
        next(cb for cb in t.callbacks if isinstance(cb, EarlyStopping))  # type: ignore[attr-defined]
        for t in (trainer, ref_trainer)
    ]
    assert torch.equal(stops[0].best_score, stops[1].best_score)
    assert stops[0].wait_count == stops[1].wait_count
    assert trainer.global_step == ref_trainer.global_step
    assert digest(model) == digest(reference)


class _SigtermAt(pl.Callback):
    """A real SIGTERM to this process before the batch after step ``step`` (coci's handler,
    chained after Lightning's, takes it; the ranks learn of it at that batch's end)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class _ValidationCounts(pl.Callback):
    """The validation loop's batch counters (this epoch's) at each validation's end."""

    def __init__(self) -> None:
        self.counts: list[dict[str, int]] = []

    def on_validation_end(self, trainer: pl.Trainer, *args: Any) -> None:
        total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
        self.counts.append(total.state_dict())


def test_a_sigterm_at_an_epochs_last_batch_before_its_validation_resumes_exactly(
    tmp_path: Path, uninterrupted: dict[bool, tuple[Any, ...]]
) -> None:
    """SIGTERM during step 16, an epoch's last batch, with the epoch's validation still to
    run after it: coci saves step 16 and exits 143 without that validation (no time for it);
    the run resumed from that save runs it (its hooks, and what it draws from the random
    streams: the loader's seed), then the epoch's end, and ends bit-identical to the run
    never stopped: every loss after step 16, weights, samples, hooks, learning rate."""
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=6, save_on_train_end=False)
    with pytest.raises(Preempted) as stop:
        _fit(tmp_path, [coci, _SigtermAt(15)], validate=True, max_steps=40)
    assert (stop.value.step, stop.value.code) == (16, 143)
    assert CheckpointManager(tmp_path / "coci").steps() == [6, 12, 16]
    counts = _ValidationCounts()
    model, trainer = _fit(
        tmp_path,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=6, keep_last=None), counts],
        validate=True,
        seed=99,  # another seed: the random states come back from the checkpoint
        ckpt_path="last",
        max_steps=40,
    )
    # its 2 batches, counted as after an uninterrupted one (a later save does not resume it)
    assert counts.counts[0] == {"ready": 2, "started": 2, "processed": 2, "completed": 2}
    ref_model, ref_trainer = uninterrupted[True]
    assert model.losses == ref_model.losses[16:]
    assert digest(model) == digest(ref_model)
    assert model.seen == ref_model.seen[16 * 16 :]
    events = ref_model.events
    assert model.events == events[events.index(("validation", 16, 0)) :]  # it, then epoch end
    lr = [t.optimizers[0].param_groups[0]["lr"] for t in (trainer, ref_trainer)]
    assert lr[0] == lr[1]
    loops = (trainer.fit_loop.epoch_loop, ref_trainer.fit_loop.epoch_loop)
    assert loops[0]._batches_that_stepped == loops[1]._batches_that_stepped


def test_a_run_resumed_before_its_last_validation_saves_its_end_over_that_checkpoint(
    tmp_path: Path,
) -> None:
    """SIGTERM during step 16, the run's last batch, with the epoch's validation after it:
    coci saves step 16 as before that validation. The run resumed from it runs the validation
    and the epoch's end, and its final save replaces that checkpoint (it was skipped as the
    step the run resumed from): the finished script, rerun as a scheduler reruns it, trains
    and validates nothing more."""

    def coci() -> CociCheckpoint:
        return CociCheckpoint(policy="every_n_steps", every_n_steps=6, keep_last=None)

    with pytest.raises(Preempted) as stop:
        _fit(tmp_path, [coci(), _SigtermAt(15)], validate=True, max_epochs=1)
    assert stop.value.step == 16
    counts = _ValidationCounts()
    model, _ = _fit(tmp_path, [coci(), counts], validate=True, ckpt_path="last", max_epochs=1)
    assert len(counts.counts) == 1 and model.events[0] == ("validation", 16, 0)
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [6, 12, 16]
        saved = mgr.restore(16)["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]
    assert saved["current"]["completed"] == saved["current"]["started"]  # none cut short
    again = _ValidationCounts()
    model, trainer = _fit(tmp_path, [coci(), again], validate=True, ckpt_path="last", max_epochs=1)
    assert again.counts == [] and model.events == [] and trainer.global_step == 16


def test_a_run_resumed_before_its_last_validation_runs_it_when_max_steps_ends_there(
    tmp_path: Path,
) -> None:
    """As above, with the run's length given as ``max_steps`` (16, an epoch's last step):
    Lightning's fit loop stops on ``max_steps`` before it looks at the restored loops, so the
    resumed run ended at once ("no step to train after it") without the validation and the
    epoch's end that the run never stopped has. Now it runs both, as with ``max_epochs``."""

    def coci() -> CociCheckpoint:
        return CociCheckpoint(policy="every_n_steps", every_n_steps=6, keep_last=None)

    with pytest.raises(Preempted) as stop:
        _fit(tmp_path, [coci(), _SigtermAt(15)], validate=True, max_steps=16)
    assert stop.value.step == 16
    model, trainer = _fit(tmp_path, [coci()], validate=True, ckpt_path="last", max_steps=16)
    assert model.events == [("validation", 16, 0), ("epoch_end", 16, 0)]
    assert trainer.global_step == 16 and trainer.current_epoch == 1
    again, _ = _fit(tmp_path, [coci()], validate=True, ckpt_path="last", max_steps=16)
    assert again.events == []  # the final save replaced the checkpoint before the validation


def test_a_max_steps_run_ended_with_an_epoch_then_extended_starts_the_next_epoch(
    tmp_path: Path, uninterrupted: dict[bool, tuple[Any, ...]]
) -> None:
    """A run of ``max_steps=16`` (an epoch's last step) ends with its final save, after the
    epoch's end; the same script with ``max_steps=40`` resumes it. Lightning treats every
    resume of a ``max_steps`` run as a restart within an epoch: it ran an empty epoch 1 (its
    epoch-end hooks) from the exhausted loader, then trained epoch 1's data as epoch 2, every
    later epoch and logged step one too many. Now the resumed run starts epoch 1 from a fresh
    loader, as a ``max_epochs`` run does: the hooks, epochs, learning rate and logged steps of
    the run never stopped. (The new epoch's shuffled order is drawn when Lightning makes the
    loader's iterator, before any hook restores the random states: as after the end of a
    ``max_epochs`` run, the order is not the uninterrupted run's.)"""
    _fit(tmp_path, [CociCheckpoint()], validate=True, max_steps=16)
    assert CheckpointManager(tmp_path / "coci").steps()[-1] == 16
    model, trainer = _fit(
        tmp_path, [CociCheckpoint()], validate=True, seed=99, ckpt_path="last", max_steps=40
    )
    ref_model, ref_trainer = uninterrupted[True]
    assert model.events == ref_model.events[ref_model.events.index(("epoch_start", 16, 1)) :]
    assert trainer.current_epoch == ref_trainer.current_epoch
    lr = [t.optimizers[0].param_groups[0]["lr"] for t in (trainer, ref_trainer)]
    assert lr[0] == lr[1]
    loops = (trainer.fit_loop.epoch_loop, ref_trainer.fit_loop.epoch_loop)
    assert loops[0]._batches_that_stepped == loops[1]._batches_that_stepped
    assert sorted(model.seen[:SAMPLES]) == list(range(SAMPLES))  # all of epoch 1, once
    assert len(model.seen) == 24 * 16

"""Lightning runs that may be stopped early: EarlyStopping's hazard in the plan, no final save
for a stopped run, and a real Optuna study pruned by optuna-integration's callback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import optuna
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from optuna_integration import PyTorchLightningPruningCallback
from torchdata.stateful_dataloader import StatefulDataLoader

from coci_core.engine.restore.restore import newest_first
from coci_core.hpo.optuna import STEP_ATTR, CheckpointCleanup
from coci_core.storage import open_storage
from coci_lightning import CociCheckpoint
from coci_lightning.hpo import OptunaTermination
from tests.lightning.models import DigitsModel, IndexedDigits

optuna.logging.set_verbosity(optuna.logging.WARNING)

STEPS_PER_EPOCH = 4  # 64 samples, batches of 16


class ValidatedDigits(DigitsModel):
    """Digits with a validation loss; ``plateau``: the logged validation metric never moves."""

    def __init__(self, lr: float = 1e-2, plateau: bool = False) -> None:
        super().__init__()
        self.lr = lr
        self.plateau = plateau

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", torch.tensor(1.0) if self.plateau else loss)

    def train_dataloader(self) -> Any:
        return StatefulDataLoader(IndexedDigits(64), batch_size=16, shuffle=True)

    def val_dataloader(self) -> Any:
        return StatefulDataLoader(IndexedDigits(64), batch_size=64)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Spy(pl.Callback):
    """Records the planner's report and explanation at the second step of each epoch, and the
    committed steps when training ends, before the CociCheckpoint's final save (Checkpoint
    callbacks run last)."""

    def __init__(self, ckpt: CociCheckpoint) -> None:
        self.ckpt = ckpt
        self.reports: list[Any] = []
        self.explained: list[str] = []
        self.before_final_save: list[int] | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.ckpt.checkpointer is not None
        self.ckpt.checkpointer.wait()
        self.before_final_save = _saved(Path(self.ckpt.resolve_dirpath(trainer)))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        planner = self.ckpt.checkpointer.planner if self.ckpt.checkpointer else None
        if planner is not None and args[-1] == 1 and trainer.current_epoch >= 1:
            self.reports.append(planner.report())
            self.explained.append(planner.explain(trainer.global_step))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # a tiny model: torch's thread pool only contends with the other tests' processes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(root: Path, callbacks: list[pl.Callback], max_epochs: int = 20) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )


def _saved(directory: Path) -> list[int]:
    return sorted(newest_first(open_storage(str(directory))))


def test_early_stopping_enters_the_plan_and_a_stopped_run_takes_no_final_save(
    tmp_path: Path,
) -> None:
    ckpt = CociCheckpoint(tmp_path / "a", every_n_steps=3, mtbf_s=600.0)
    spy = Spy(ckpt)
    stopper = EarlyStopping(monitor="val_loss", patience=3)
    trainer = _trainer(tmp_path, [stopper, ckpt, spy])
    pl.seed_everything(0, verbose=False)
    trainer.fit(ValidatedDigits(plateau=True))
    # a flat metric: the first validation improves (from inf), three more do not: stop
    assert trainer.global_step == 4 * STEPS_PER_EPOCH
    assert spy.reports, "the spy saw the run"
    rep = spy.reports[-1]
    assert rep.objective == "time"  # the default objective keeps the termination hazard
    assert rep.termination.startswith("EarlyStopping(monitor='val_loss', patience 3, wait 2")
    # at wait 2 of 3 with a metric that has not improved lately, a stop is likely and soon
    assert rep.stop_probability > 0.5
    assert "termination hazard: EarlyStopping" in spy.explained[-1]
    assert "the hazard accounts for" in spy.explained[-1]
    # the run was stopped: no final save, only the planned ones (every <= 3; the last step's
    # too when the plan has it: taken before the epoch's end, where EarlyStopping stops)
    saved = _saved(tmp_path / "a")
    assert saved and spy.before_final_save and saved[-1] == spy.before_final_save[-1]

    kept = CociCheckpoint(tmp_path / "b", every_n_steps=3, mtbf_s=600.0, save_when_stopped=True)
    trainer = _trainer(tmp_path, [EarlyStopping(monitor="val_loss", patience=3), kept])
    pl.seed_everything(0, verbose=False)
    trainer.fit(ValidatedDigits(plateau=True))
    assert _saved(tmp_path / "b")[-1] == trainer.global_step


@pytest.mark.parametrize("termination_first", [False, True])
def test_a_real_optuna_study_pruned_by_the_lightning_callback(
    tmp_path: Path, termination_first: bool
) -> None:
    def directory_of(trial: optuna.trial.FrozenTrial | optuna.Trial) -> Path:
        return tmp_path / f"trial-{trial.number}"

    seen: dict[int, list[str]] = {}

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 1e-4, 1.0, log=True)
        ckpt = CociCheckpoint(directory_of(trial), every_n_steps=3, mtbf_s=600.0)
        spy = Spy(ckpt)
        # (min_trials=1: in a study this small the rank weighting keeps about one trial)
        callbacks = [
            PyTorchLightningPruningCallback(trial, monitor="val_loss"),
            OptunaTermination(trial, min_trials=1),
        ]
        if termination_first:  # its on_validation_end comes before the pruning callback's report
            callbacks.reverse()
        trainer = _trainer(
            tmp_path,
            [*callbacks, ckpt, spy],
            max_epochs=3,
        )
        pl.seed_everything(trial.number, verbose=False)
        try:
            trainer.fit(ValidatedDigits(lr=lr))
        finally:
            seen[trial.number] = [r.termination for r in spy.reports]
        return float(trainer.callback_metrics["val_loss"])

    study = optuna.create_study(
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3), study_name="digits"
    )
    for lr in (0.3, 0.2, 0.25, 1e-4, 2e-4, 0.3):  # good ones first; the slow ones get pruned
        study.enqueue_trial({"lr": lr})
    cleanup = CheckpointCleanup(directory_of)
    study.optimize(objective, n_trials=6, callbacks=[cleanup])
    states = [t.state for t in study.trials]
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, states
    for t in pruned:
        # pruned at a validation: its training step was recorded; its checkpoints deleted
        assert t.user_attrs[STEP_ATTR] % STEPS_PER_EPOCH == 0
        assert not directory_of(t).exists()
    # the first trials plan with no termination (median pruner: no rungs, no history) ...
    assert all(term == "none" for term in seen[0])
    # ... the last with the study's Kaplan-Meier estimate, refreshed as the study grew
    assert seen[5] and "Optuna study 'digits'" in seen[5][-1]
    # once the trial has reported, weighted by how its value ranks in the study, whatever the
    # callbacks' order
    assert "weighted by the rank of the trial's value" in seen[5][-1]
    assert directory_of(study.trials[0]).exists()  # ran to its end: kept


def test_only_early_stopping_and_pruning_count_asstopped_early() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import Timer

    from coci_lightning._stopping import stopped_early

    stopper = EarlyStopping(monitor="val_loss", patience=2)
    timed = SimpleNamespace(should_stop=True, callbacks=[Timer(duration="00:00:01:00"), stopper])
    assert not stopped_early(timed)  # type: ignore[arg-type]  # max_time, not a stop
    stopper.wait_count = 2  # as EarlyStopping leaves it when its patience ran out
    reason = getattr(stopper, "stopping_reason", None)
    if reason is not None:
        stopper.stopping_reason = type(reason).PATIENCE_EXHAUSTED
    assert stopped_early(timed)  # type: ignore[arg-type]
    assert not stopped_early(SimpleNamespace(should_stop=False, callbacks=[stopper]))  # type: ignore[arg-type]


class Descending(ValidatedDigits):
    """A validation metric that falls by 0.1 per epoch from 1.0, whatever the training does."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(1.0 - 0.1 * self.current_epoch))


@pytest.mark.parametrize("threshold", [None, 0.35])
def test_early_stoppings_stopping_threshold_enters_the_plan(
    tmp_path: Path, threshold: float | None
) -> None:
    ckpt = CociCheckpoint(tmp_path / "a", every_n_steps=3, mtbf_s=600.0)
    spy = Spy(ckpt)
    stopper = EarlyStopping(monitor="val_loss", patience=10, stopping_threshold=threshold)
    trainer = _trainer(tmp_path, [stopper, ckpt, spy], max_epochs=12)
    trainer.fit(Descending())
    if threshold is None:
        # improving at every validation with a patience of 10: no stop is in sight
        assert trainer.global_step == 12 * STEPS_PER_EPOCH
        assert all(r.stop_probability < 0.05 for r in spy.reports)
        assert "stopping_threshold" not in spy.reports[-1].termination
        return
    # 0.3 < 0.35 at the eighth validation (epoch 7): EarlyStopping stops there
    assert trainer.global_step == 8 * STEPS_PER_EPOCH
    # in epoch 5, after five validations on a straight line, the crossing is sure and near
    rep = spy.reports[4]
    assert "stopping_threshold 0.35" in rep.termination
    assert rep.stop_probability > 0.95
    assert "termination hazard: EarlyStopping" in spy.explained[4]
    # in epoch 1, after two validations, the trend is not yet estimated: no stop is planned
    assert spy.reports[0].stop_probability < 0.05

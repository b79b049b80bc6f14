"""Optuna trials trained by a Lightning Trainer: the trial's termination hazard from its study.

``OptunaTermination(trial)`` beside a :class:`~coci_lightning.CociCheckpoint` (and, for
pruning, optuna-integration's ``PyTorchLightningPruningCallback``) estimates when the study's
pruner is likely to stop this trial (:func:`coci_core.hpo.optuna.study_termination`) when
training starts, at each validation and at each epoch's start (the study grows as other trials
end, and the trial's own reports count), and hands
it to the checkpoint's planner. It records the training step of each validation in the trial
(user attribute ``coci_step``) for later trials' estimates, and marks a trial that
``EarlyStopping`` ended (``coci_early_stopped``) for
:class:`~coci_core.hpo.optuna.CheckpointCleanup`.
"""

from __future__ import annotations

import lightning.pytorch as pl
import optuna
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from coci_core.errors import ConfigError
from coci_core.hpo.optuna import EARLY_STOPPED_ATTR, STEP_ATTR, StepMap, study_termination
from coci_core.planner import Termination
from coci_lightning._stopping import stopped_early
from coci_lightning.callback import CociCheckpoint

__all__ = ["OptunaTermination"]


class OptunaTermination(Callback):
    """Plans a trial's checkpoints with the probability that its study's pruner stops it.

    Args:
        trial: the Optuna trial this Trainer trains.
        min_trials: finished trials needed before the study's history is used (until then,
            the pruner's rungs, or no termination).
        train_step_of: maps other trials' report steps to training steps when they have no
            recorded ``coci_step`` (see :func:`coci_core.hpo.optuna.study_termination`).
        max_report_step: the last report step (bounds the pruner's fallback rungs; default:
            the Trainer's ``max_epochs - 1``, as the pruning callback reports epochs).
        rank_bandwidth: how the trial's own reported values weigh the study's other trials
            (see :func:`coci_core.hpo.optuna.rank_weights`); None: all alike.
    """

    def __init__(
        self,
        trial: optuna.trial.BaseTrial,
        *,
        min_trials: int = 3,
        train_step_of: StepMap | None = None,
        max_report_step: int | None = None,
        rank_bandwidth: float | None = 0.2,
    ) -> None:
        super().__init__()
        self.trial = trial
        self.rank_bandwidth = rank_bandwidth
        self.min_trials = min_trials
        self.train_step_of = train_step_of
        self.max_report_step = max_report_step
        self.termination: Termination | None = None  # the newest estimate

    def _checkpoint(self, trainer: pl.Trainer) -> CociCheckpoint:
        found = [cb for cb in trainer.callbacks if isinstance(cb, CociCheckpoint)]  # type: ignore[attr-defined]
        if not found:
            raise ConfigError("OptunaTermination needs a CociCheckpoint callback on the Trainer")
        return found[0]

    def _refresh(self, trainer: pl.Trainer) -> None:
        top = self.max_report_step
        if top is None and trainer.max_epochs is not None and trainer.max_epochs > 0:
            top = trainer.max_epochs - 1
        train_step_of = self.train_step_of
        if train_step_of is None and trainer.num_training_batches not in (0, float("inf")):
            per_epoch = max(
                1, int(trainer.num_training_batches) // max(1, trainer.accumulate_grad_batches)
            )
            train_step_of = lambda epoch: (int(epoch) + 1) * per_epoch  # noqa: E731
        self.termination = study_termination(
            self.trial.study,  # type: ignore[attr-defined]
            trial=self.trial,
            train_step_of=train_step_of,
            min_trials=self.min_trials,
            max_report_step=top,
            rank_bandwidth=self.rank_bandwidth,
        )
        self._checkpoint(trainer).set_termination("optuna", self.termination)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._refresh(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the pruning callback reports at on_validation_end, maybe after this callback's: the
        # trial's newest value is in the study by the next epoch
        if trainer.current_epoch > 0:
            self._refresh(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before any callback's on_validation_end (where the pruning callback may raise)
        if not trainer.sanity_checking and trainer.is_global_zero:
            self.trial.set_user_attr(STEP_ATTR, int(trainer.global_step))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._refresh(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if stopped_early(trainer) and trainer.is_global_zero:
            self.trial.set_user_attr(EARLY_STOPPED_ATTR, True)

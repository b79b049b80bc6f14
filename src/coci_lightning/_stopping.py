"""Lightning runs stopped on purpose: ``EarlyStopping``'s hazard for the plan, and whether a
run was stopped early (by ``EarlyStopping`` or optuna-integration's pruning callback)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping

from coci_core.planner import Termination
from coci_core.training import ValidationHistory


def early_stopping_of(trainer: pl.Trainer) -> EarlyStopping | None:
    """The Trainer's first ``EarlyStopping`` callback, if any."""
    found = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)]  # type: ignore[attr-defined]
    return found[0] if found else None


def early_stopping_hazard(
    history: ValidationHistory,
    trainer: pl.Trainer,
    stopper: EarlyStopping,
    *,
    start: int,
    total: int | None,
) -> Termination | None:
    """After ``EarlyStopping`` judged a validation (Checkpoint callbacks run after the
    others): the probability that it stops the run at each coming validation, from its
    patience and wait count and how often the metric improved lately, as the plan's
    termination hazard (see :mod:`coci_core.hpo.early_stopping`). None when it judged no new
    validation."""
    if stopper.monitor not in trainer.callback_metrics:
        return None  # EarlyStopping did not judge this validation
    value = float(trainer.callback_metrics[stopper.monitor])
    if not history.add(trainer.global_step, improved=stopper.wait_count == 0, value=value):
        return None
    good, bad = stopper.stopping_threshold, stopper.divergence_threshold
    return history.termination(
        rule=f"EarlyStopping(monitor={stopper.monitor!r}",
        start=start,
        total=total,
        patience=int(stopper.patience),
        wait_count=int(stopper.wait_count),
        min_delta=float(stopper.min_delta),
        mode=stopper.mode,
        stopping_threshold=None if good is None else float(good),
        divergence_threshold=None if bad is None else float(bad),
    )


def stopped_early(trainer: pl.Trainer) -> bool:
    """Whether ``EarlyStopping`` stopped the run, or optuna-integration's pruning callback did
    (with several processes it stops the Trainer instead of raising); not ``max_time``."""
    if not trainer.should_stop:
        return False
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, EarlyStopping):
            reason = getattr(cb, "stopping_reason", None)  # Lightning >= 2.5.1
            if reason is not None and getattr(reason, "name", "") != "NOT_STOPPED":
                return True
            if reason is None and cb.wait_count >= cb.patience:
                return True
        if type(cb).__name__ == "PyTorchLightningPruningCallback":
            return True
    return False

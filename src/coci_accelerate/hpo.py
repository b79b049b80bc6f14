"""Optuna trials trained with Accelerate: the trial's termination hazard from its study.

Thin helpers around :mod:`coci_core.hpo.optuna` for a ``CociCheckpointer`` loop::

    ckpt = CociCheckpointer(accelerator, dirpath, planner_options=optuna_planner_options(trial))
    ...
    if report(ckpt, trial, val_loss, epoch):   # records the step, re-estimates, asks the pruner
        close_stopped(ckpt)                    # no final save for a pruned trial
        raise optuna.TrialPruned()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from coci_accelerate.checkpointer import CociCheckpointer
from coci_core.hpo import optuna as coci_optuna
from coci_core.planner import Termination

__all__ = ["close_stopped", "optuna_planner_options", "refresh_termination", "report"]


def optuna_planner_options(
    trial: optuna.trial.BaseTrial,
    planner_options: Mapping[str, Any] | None = None,
    **arguments: Any,
) -> dict[str, Any]:
    """``planner_options`` for ``CociCheckpointer`` with the trial's termination model from its
    study (``arguments``: those of :func:`coci_core.hpo.optuna.study_termination`)."""
    return coci_optuna.planner_options(trial, planner_options, **arguments)


def refresh_termination(
    ckpt: CociCheckpointer, trial: optuna.trial.BaseTrial, **arguments: Any
) -> Termination:
    """Re-estimate the trial's termination model from its study as it is now, and plan with
    it from the next step on."""
    model = coci_optuna.study_termination(trial.study, trial=trial, **arguments)  # type: ignore[attr-defined]
    ckpt.checkpointer.planner.set_termination(model)
    return model


def report(
    ckpt: CociCheckpointer,
    trial: optuna.trial.Trial,
    value: float,
    step: int,
    *,
    refresh: bool = True,
    **arguments: Any,
) -> bool:
    """Report ``value`` at report step ``step`` (recording the optimizer steps completed so far
    for later trials' estimates), re-estimate the termination model (``refresh``), and return
    whether the study prunes the trial (asked once per step, see
    :func:`coci_core.hpo.optuna.should_prune`)."""
    coci_optuna.report(trial, value, step, train_step=ckpt.completed_steps)
    if refresh:
        refresh_termination(ckpt, trial, **arguments)
    return coci_optuna.should_prune(trial, step)


def close_stopped(
    ckpt: CociCheckpointer, trial: optuna.trial.Trial | None = None, *, early_stopped: bool = False
) -> None:
    """Close a trial's checkpointer that was stopped early (pruned, or early-stopped): no final
    save. ``early_stopped`` marks the trial for
    :class:`~coci_core.hpo.optuna.CheckpointCleanup` (its checkpoints are deleted unless it
    turns out the best)."""
    ckpt.close(save=False)
    if early_stopped and trial is not None:
        trial.set_user_attr(coci_optuna.EARLY_STOPPED_ATTR, True)
